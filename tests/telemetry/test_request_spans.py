"""P1's request spans from step timestamps (in-memory exporter, no engine)."""

from __future__ import annotations

import dataclasses
import threading

from opentelemetry.context import Context
from opentelemetry.sdk.trace import Span, SpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mmis.telemetry import genai
from mmis.telemetry.request_spans import RequestSpans
from mmis.telemetry.tracing import Tracing, inject, setup_tracing
from mmis.telemetry.tracing_config import TracingConfig


@dataclasses.dataclass
class Scheduled:
    request_id: str
    encoder_inputs: list[int]


@dataclasses.dataclass
class Event:
    request_id: str
    new_token_ids: list[int]
    finish_reason: object = None
    num_prompt_tokens: int = 10
    num_cached_tokens: int = 4


def _setup() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return setup_tracing(TracingConfig(), exporter=exporter), exporter


def test_a_finished_request_emits_its_phases_under_p0s_context() -> None:
    p0, p0_spans = _setup()
    p1, p1_spans = _setup()
    with p0.span("engine") as parent:
        carrier = inject()
    spans = RequestSpans(p1)
    spans.admit("r", carrier, now_ns=1_000)
    spans.on_step([Scheduled("r", [0])], [Event("r", [5])], 2_000, 3_000)  # prefill + encoder
    spans.on_step([Scheduled("r", [])], [Event("r", [6])], 4_000, 5_000)
    assert p1_spans.get_finished_spans() == ()  # nothing until it finishes
    spans.on_step([Scheduled("r", [])], [Event("r", [7], finish_reason="length")], 6_000, 7_000)
    assert len(spans) == 0

    by_name = {s.name: s for s in p1_spans.get_finished_spans()}
    core = by_name["engine_core"]
    assert core.parent is not None and core.parent.span_id == parent.get_span_context().span_id
    assert (core.start_time, core.end_time) == (1_000, 7_000)
    attrs = dict(core.attributes or {})
    assert attrs[genai.USAGE_OUTPUT_TOKENS] == 3 and attrs[genai.USAGE_INPUT_TOKENS] == 10
    assert attrs[genai.USAGE_CACHE_READ_INPUT_TOKENS] == 4
    assert attrs["mmis.finish_reason"] == "length"
    windows = {
        n: (by_name[n].start_time, by_name[n].end_time) for n in by_name if n != "engine_core"
    }
    assert windows == {
        "queue": (1_000, 2_000),
        "prefill": (2_000, 3_000),
        "decode": (3_000, 7_000),
        "encoder": (2_000, 3_000),
    }
    for name in windows:
        assert by_name[name].parent.span_id == core.context.span_id  # type: ignore[union-attr]
    assert p0_spans.get_finished_spans()[0].context.trace_id == core.context.trace_id


def test_aborted_requests_are_forgotten_and_tracking_is_bounded() -> None:
    p1, exported = _setup()
    spans = RequestSpans(p1, max_tracked=2)
    for rid in ("a", "b", "c"):
        spans.admit(rid, {})
    assert len(spans) == 2  # "a", the oldest, was dropped
    spans.forget(["b"])
    spans.on_step([], [Event("a", [1], "stop"), Event("b", [1], "stop")], 1, 2)
    assert exported.get_finished_spans() == ()  # neither is tracked any more
    spans.on_step([Scheduled("c", [])], [Event("c", [1], "stop")], 3, 4)
    assert "engine_core" in {s.name for s in exported.get_finished_spans()}


class _ThreadRecorder(SpanProcessor):
    """Records which thread started each span; can hold the first ``on_start`` until released."""

    def __init__(self) -> None:
        self.threads: list[str] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        assert self.release.wait(30), "the test never released the emitter"


def _background_setup() -> tuple[Tracing, InMemorySpanExporter, _ThreadRecorder]:
    p1, exported = _setup()
    recorder = _ThreadRecorder()
    assert p1.provider is not None
    p1.provider.add_span_processor(recorder)
    return p1, exported, recorder


def test_background_spans_are_built_on_the_emitter_thread_and_close_drains_them() -> None:
    p1, exported, recorder = _background_setup()
    spans = RequestSpans(p1, background=True)
    try:
        for rid in ("a", "b"):
            spans.admit(rid, {}, now_ns=1_000)
            spans.on_step([Scheduled(rid, [0])], [Event(rid, [5], "stop")], 2_000, 3_000)
    finally:
        spans.close()
    names = sorted(s.name for s in exported.get_finished_spans())
    assert names == sorted(["engine_core", "queue", "prefill", "encoder"] * 2)
    assert set(recorder.threads) == {"mmis-spans"}  # never the caller's (the busy loop's)
    spans.close()  # idempotent


def test_background_queue_is_bounded_and_drops_are_counted() -> None:
    p1, exported, recorder = _background_setup()
    recorder.release.clear()
    spans = RequestSpans(p1, max_tracked=2, background=True)
    try:
        spans.admit("a", {})
        spans.on_step([], [Event("a", [1], "stop")], 1, 2)
        assert recorder.entered.wait(30)  # the emitter holds "a"; the queue is empty
        for t, rid in enumerate(("b", "c", "d")):
            spans.admit(rid, {})
            spans.on_step([], [Event(rid, [1], "stop")], 10 * t + 1, 10 * t + 2)
        assert spans.dropped == 1  # "b" and "c" wait in the queue, "d" found it full
    finally:
        recorder.release.set()
        spans.close()
    roots = [s for s in exported.get_finished_spans() if s.name == "engine_core"]
    assert [s.end_time for s in roots] == [2, 2, 12]  # "a", "b", "c"


def test_phase_spans_share_the_roots_scope_resource_and_sampling_decision() -> None:
    p1, exported = _setup()
    spans = RequestSpans(p1)
    spans.admit("r", {}, now_ns=1_000)
    spans.on_step([Scheduled("r", [0])], [Event("r", [5], "stop")], 2_000, 3_000)
    by_name = {s.name: s for s in exported.get_finished_spans()}
    root = by_name.pop("engine_core")
    assert set(by_name) == {"queue", "prefill", "encoder"}
    for child in by_name.values():
        assert child.instrumentation_scope is root.instrumentation_scope
        assert child.resource is root.resource
        assert child.context.trace_id == root.context.trace_id
        assert child.context.span_id != root.context.span_id
        assert child.kind.name == "INTERNAL" and child.status.status_code.name == "UNSET"
    assert dict(by_name["encoder"].attributes or {}) == {"mmis.encoder.items": 1}

    # a root the sampler dropped takes its phases with it: nothing at all is exported
    unsampled, nothing = _setup()
    with unsampled.span("engine"):
        carrier = inject()
    carrier["traceparent"] = carrier["traceparent"][:-2] + "00"  # P0 did not sample it
    dropped = RequestSpans(unsampled)
    dropped.admit("s", carrier, now_ns=1_000)
    dropped.on_step([Scheduled("s", [0])], [Event("s", [5], "stop")], 2_000, 3_000)
    assert [s.name for s in nothing.get_finished_spans()] == ["engine"]
