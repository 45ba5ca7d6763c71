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

With ``background=True`` (what ``mmis engine`` uses) the busy loop only appends a finished
request's timestamps to a list; a daemon thread takes the whole list every ``interval``
seconds and builds and ends the spans, so the OpenTelemetry SDK's per-span work (about 20 us
a span) runs beside the steps instead of inside them, and the busy loop never wakes a thread
(a wake-up per request costs more than the append). :meth:`RequestSpans.close` emits what is
left; call it before shutting the provider down.

Invariants:
- Nothing here imports the engine: scheduled items and events are read through the small
  protocols below (duck typing), so the core passes its own objects unchanged.
- Memory is bounded: at most ``max_tracked`` requests are tracked (the oldest is dropped
  without a span), finished and aborted ones are forgotten at once, and at most
  ``max_tracked`` finished requests wait for the emitter thread (beyond that their spans are
  dropped and counted in ``dropped``). The list is only ever swapped whole (one assignment
  under the GIL), so no request is lost or emitted twice between the two threads.
- Only built when tracing is on; the core holds ``None`` otherwise (no cost when off).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from opentelemetry import trace

from mmis.telemetry import genai
from mmis.telemetry.tracing import Tracing, extract

ENGINE_SPAN = "engine_core"
QUEUE_SPAN = "queue"
PREFILL_SPAN = "prefill"
DECODE_SPAN = "decode"
ENCODER_SPAN = "encoder"
ATTR_FINISH_REASON = "mmis.finish_reason"
ATTR_ENCODER_ITEMS = "mmis.encoder.items"

log = logging.getLogger(__name__)


class ScheduledLike(Protocol):
    @property
    def request_id(self) -> str: ...

    @property
    def encoder_inputs(self) -> Sequence[int]: ...


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


@dataclasses.dataclass(frozen=True)
class _Finished:
    """What the spans of a finished request are built from (copied out of the event)."""

    track: _Track
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str
    end_ns: int


class RequestSpans:
    def __init__(
        self,
        tracing: Tracing,
        max_tracked: int = 10_000,
        background: bool = False,
        interval: float = 0.05,
    ) -> None:
        self.tracing = tracing
        self.max_tracked = max_tracked
        self.dropped = 0  # finished requests whose spans were dropped (emitter behind)
        self._tracks: collections.OrderedDict[str, _Track] = collections.OrderedDict()
        self._finished: list[_Finished] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(
                target=self._emit_loop, args=(interval,), name="mmis-spans", daemon=True
            )
            self._thread.start()

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
                finished = _Finished(
                    track,
                    event.num_prompt_tokens,
                    event.num_cached_tokens,
                    _reason(event.finish_reason),
                    end_ns,
                )
                if self._thread is None:
                    self._emit(finished)
                elif len(self._finished) < self.max_tracked:
                    self._finished.append(finished)
                else:
                    self.dropped += 1

    def close(self, timeout: float = 10.0) -> None:
        """Emit every waiting request's spans and stop the emitter thread (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _emit_loop(self, interval: float) -> None:
        while True:
            stopping = self._stop.wait(interval)
            batch, self._finished = self._finished, []
            for finished in batch:
                try:
                    self._emit(finished)
                except Exception:  # a tracing bug must never stop the engine's spans for good
                    log.exception("could not emit a request's spans")
            if stopping:
                return

    def _emit(self, finished: _Finished) -> None:
        track, end_ns = finished.track, finished.end_ns
        usage = genai.usage_attributes(
            finished.prompt_tokens,
            track.output_tokens,
            min(finished.cached_tokens, finished.prompt_tokens),
        )
        root = self.tracing.start(
            ENGINE_SPAN,
            context=extract(track.carrier),
            kind=trace.SpanKind.SERVER,
            attributes={**usage, ATTR_FINISH_REASON: finished.finish_reason},
            start_time=track.admitted_ns,
        )
        scheduled = track.scheduled_ns or end_ns
        first = track.first_token_ns
        phases = [(QUEUE_SPAN, track.admitted_ns, scheduled)]
        phases.append((PREFILL_SPAN, scheduled, first if first is not None else end_ns))
        if first is not None and first < end_ns:
            phases.append((DECODE_SPAN, first, end_ns))
        for name, start, end in phases:
            self.tracing.record_finished(root, name, start, end)
        for start, end, items in track.encoder_steps:
            attrs = {ATTR_ENCODER_ITEMS: items}
            self.tracing.record_finished(root, ENCODER_SPAN, start, end, attrs)
        root.end(end_time=end_ns)
