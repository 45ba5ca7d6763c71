"""P1's spans of a request, built from timestamps the engine core already passes through.

The core reports three things (each one call, from its busy-loop thread only):
:meth:`RequestSpans.admit` when a request enters the scheduler (with the trace context P0
put into ``EngineCoreRequest.trace_context``), :meth:`RequestSpans.on_step` after each step
(the requests scheduled, the events produced, the step's start and end) and
:meth:`RequestSpans.forget` for aborted requests. When a request finishes, its spans are
emitted at once, with explicit start and end times:

- ``engine_core`` (admission -> finish), a child of P0's ``engine`` span, carrying the GenAI
  usage attributes and ``mmis.finish_reason``;
- its children ``queue`` (admission -> first scheduled step), ``prefill`` (first scheduled
  step -> first token, or the finish of a pooling request), ``decode`` (first token ->
  finish) and one ``encoder`` span per step that ran the vision encoder for the request
  (the step's window; ``mmis.encoder.items`` says how many items it encoded).

Invariants:
- Nothing here imports the engine: scheduled items and events are read through the small
  protocols below (duck typing), so the core passes its own objects unchanged.
- Memory is bounded: at most ``max_tracked`` requests are tracked (the oldest is dropped
  without a span), finished and aborted ones are forgotten at once.
- Only built when tracing is on; the core holds ``None`` otherwise (no cost when off).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from opentelemetry import trace

from mmis.server.telemetry import genai
from mmis.server.telemetry.tracing import Tracing, extract

ENGINE_SPAN = "engine_core"
QUEUE_SPAN = "queue"
PREFILL_SPAN = "prefill"
DECODE_SPAN = "decode"
ENCODER_SPAN = "encoder"
ATTR_FINISH_REASON = "mmis.finish_reason"
ATTR_ENCODER_ITEMS = "mmis.encoder.items"


class ScheduledLike(Protocol):
    @property
    def request_id(self) -> str: ...

    @property
    def encoder_inputs(self) -> list[int]: ...


class EventLike(Protocol):
    @property
    def request_id(self) -> str: ...

    @property
    def new_token_ids(self) -> list[int]: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_cached_tokens(self) -> int: ...

    @property
    def finish_reason(self) -> object: ...


@dataclasses.dataclass
class _Track:
    carrier: Mapping[str, str]
    admitted_ns: int
    scheduled_ns: int | None = None
    first_token_ns: int | None = None
    output_tokens: int = 0
    encoder_steps: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)


def _reason(value: object) -> str:
    return str(getattr(value, "value", value))


class RequestSpans:
    def __init__(self, tracing: Tracing, max_tracked: int = 10_000) -> None:
        self.tracing = tracing
        self.max_tracked = max_tracked
        self._tracks: collections.OrderedDict[str, _Track] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._tracks)

    def admit(self, request_id: str, carrier: Mapping[str, str], now_ns: int | None = None) -> None:
        self._tracks[request_id] = _Track(dict(carrier), now_ns or time.time_ns())
        while len(self._tracks) > self.max_tracked:
            self._tracks.popitem(last=False)

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._tracks.pop(rid, None)

    def on_step(
        self,
        scheduled: Sequence[ScheduledLike],
        events: Sequence[EventLike],
        start_ns: int,
        end_ns: int,
    ) -> None:
        for item in scheduled:
            track = self._tracks.get(item.request_id)
            if track is None:
                continue
            if track.scheduled_ns is None:
                track.scheduled_ns = start_ns
            if item.encoder_inputs:
                track.encoder_steps.append((start_ns, end_ns, len(item.encoder_inputs)))
        for event in events:
            track = self._tracks.get(event.request_id)
            if track is None:
                continue
            if event.new_token_ids:
                track.output_tokens += len(event.new_token_ids)
                if track.first_token_ns is None:
                    track.first_token_ns = end_ns
            if event.finish_reason is not None:
                del self._tracks[event.request_id]
                self._emit(track, event, end_ns)

    def _emit(self, track: _Track, event: EventLike, end_ns: int) -> None:
        usage = genai.usage_attributes(
            event.num_prompt_tokens,
            track.output_tokens,
            min(event.num_cached_tokens, event.num_prompt_tokens),
        )
        root = self.tracing.start(
            ENGINE_SPAN,
            context=extract(track.carrier),
            kind=trace.SpanKind.SERVER,
            attributes={**usage, ATTR_FINISH_REASON: _reason(event.finish_reason)},
            start_time=track.admitted_ns,
        )
        parent = trace.set_span_in_context(root)
        scheduled = track.scheduled_ns or end_ns
        first = track.first_token_ns
        phases = [(QUEUE_SPAN, track.admitted_ns, scheduled)]
        phases.append((PREFILL_SPAN, scheduled, first if first is not None else end_ns))
        if first is not None and first < end_ns:
            phases.append((DECODE_SPAN, first, end_ns))
        for name, start, end in phases:
            self.tracing.start(name, context=parent, start_time=start).end(end_time=end)
        for start, end, items in track.encoder_steps:
            span = self.tracing.start(
                ENCODER_SPAN,
                context=parent,
                attributes={ATTR_ENCODER_ITEMS: items},
                start_time=start,
            )
            span.end(end_time=end)
        root.end(end_time=end_ns)
