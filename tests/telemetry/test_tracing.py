"""Tracing: no cost when off, P0 -> P1 propagation through the real wire codec, cache events."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mmis.protocol import EngineCoreRequest, WireCodec
from mmis.telemetry import genai
from mmis.telemetry.errors import CacheEventError
from mmis.telemetry.tracing import (
    ATTR_ATTEMPT,
    ATTR_HASHES_COUNT,
    ATTR_OUTCOME,
    CACHE_INVALIDATION,
    CACHE_MISS,
    RETRY,
    Tracing,
    extract,
    inject,
    record_cache_event,
    setup_tracing,
)
from mmis.telemetry.tracing_config import TracingConfig

ON = TracingConfig(otlp_traces_endpoint="http://127.0.0.1:1")  # never reached: exporter injected


def test_off_creates_no_provider_processor_or_span(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []
    for cls in (TracerProvider, BatchSpanProcessor, SimpleSpanProcessor):
        original = cls.__init__

        def spy(
            self: object, *a: object, _o: object = original, _n: str = cls.__name__, **k: object
        ) -> None:
            built.append(_n)
            _o(self, *a, **k)  # type: ignore[operator]

        monkeypatch.setattr(cls, "__init__", spy)
    tracing = setup_tracing(TracingConfig.from_env({}))
    assert not tracing.enabled and tracing.provider is None
    assert isinstance(tracing.tracer, trace.NoOpTracer)
    with tracing.span("chat m", kind=trace.SpanKind.SERVER) as span:
        assert not span.is_recording()
        assert inject() == {}
        record_cache_event(span, CACHE_MISS, 2, 1, "retrying")
    with tracing.tracer.start_as_current_span("chat m") as span:
        assert not span.is_recording()
        assert inject() == {}
    assert tracing.force_flush()
    tracing.shutdown()
    assert built == []
    # the spies are live: turning tracing on goes through them
    setup_tracing(ON, exporter=InMemorySpanExporter()).shutdown()
    assert built == ["TracerProvider", "SimpleSpanProcessor"]


def test_off_does_not_even_import_the_sdk() -> None:
    code = textwrap.dedent(
        """
        import sys
        from mmis.telemetry.tracing import setup_tracing, inject
        from mmis.telemetry.tracing_config import TracingConfig
        t = setup_tracing(TracingConfig.from_env({}))
        with t.tracer.start_as_current_span("x"):
            assert inject() == {}
        heavy = ("opentelemetry.sdk", "opentelemetry.exporter", "grpc")
        loaded = sorted(m for m in sys.modules if m.startswith(heavy))
        print(loaded)
        raise SystemExit(1 if loaded else 0)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _two_processes() -> tuple[Tracing, InMemorySpanExporter, Tracing, InMemorySpanExporter]:
    p0_spans, p1_spans = InMemorySpanExporter(), InMemorySpanExporter()
    return (
        setup_tracing(ON, exporter=p0_spans),
        p0_spans,
        setup_tracing(ON, exporter=p1_spans),
        p1_spans,
    )


def _through_the_wire(carrier: dict[str, str]) -> EngineCoreRequest:
    codec = WireCodec()
    request = EngineCoreRequest(request_id="r-1", prompt_token_ids=[1, 2, 3], trace_context=carrier)
    _, decoded = codec.decode_request(codec.encode_request(request))
    assert isinstance(decoded, EngineCoreRequest)
    return decoded


def test_p1_spans_continue_the_p0_trace() -> None:
    p0, p0_spans, p1, p1_spans = _two_processes()
    with p0.tracer.start_as_current_span(
        genai.span_name(genai.OP_CHAT, "tiny"),
        kind=trace.SpanKind.SERVER,
        attributes=genai.request_attributes(genai.OP_CHAT, "tiny"),
    ) as http_span:
        record_cache_event(http_span, CACHE_MISS, hashes_count=2, attempt=1, outcome="retrying")
        record_cache_event(
            http_span, CACHE_INVALIDATION, hashes_count=2, attempt=1, outcome="invalidated"
        )
        record_cache_event(http_span, RETRY, hashes_count=2, attempt=2, outcome="success")
        http_span.set_attributes(genai.usage_attributes(12, 5, cache_read_input_tokens=8))
        request = _through_the_wire(inject())
    assert "traceparent" in request.trace_context

    parent = extract(request.trace_context)
    with p1.span("engine.request", context=parent) as engine_span:
        with p1.span("engine.prefill"):
            pass
        record_cache_event(engine_span, CACHE_MISS, hashes_count=2, attempt=1, outcome="reported")

    (http,) = p0_spans.get_finished_spans()
    by_name: dict[str, ReadableSpan] = {s.name: s for s in p1_spans.get_finished_spans()}
    assert set(by_name) == {"engine.request", "engine.prefill"}
    assert http.name == "chat tiny"
    trace_id = http.context.trace_id
    assert {s.context.trace_id for s in by_name.values()} == {trace_id}
    assert by_name["engine.request"].parent is not None
    assert by_name["engine.request"].parent.span_id == http.context.span_id
    assert by_name["engine.request"].parent.is_remote
    assert by_name["engine.prefill"].parent is not None
    assert by_name["engine.prefill"].parent.span_id == by_name["engine.request"].context.span_id

    events = [(e.name, dict(e.attributes or {})) for e in http.events]
    assert events == [
        (CACHE_MISS, {ATTR_HASHES_COUNT: 2, ATTR_ATTEMPT: 1, ATTR_OUTCOME: "retrying"}),
        (CACHE_INVALIDATION, {ATTR_HASHES_COUNT: 2, ATTR_ATTEMPT: 1, ATTR_OUTCOME: "invalidated"}),
        (RETRY, {ATTR_HASHES_COUNT: 2, ATTR_ATTEMPT: 2, ATTR_OUTCOME: "success"}),
    ]
    assert [e.name for e in by_name["engine.request"].events] == [CACHE_MISS]
    attributes = dict(http.attributes or {})
    assert attributes[genai.OPERATION_NAME] == "chat"
    assert attributes[genai.REQUEST_MODEL] == "tiny"
    assert attributes[genai.USAGE_INPUT_TOKENS] == 12
    assert attributes[genai.USAGE_CACHE_READ_INPUT_TOKENS] == 8


def test_an_unsampled_p0_request_is_not_traced_in_p1_either() -> None:
    p0_spans, p1_spans = InMemorySpanExporter(), InMemorySpanExporter()
    off = TracingConfig(otlp_traces_endpoint="http://127.0.0.1:1", sampling_ratio=0.0)
    p0 = setup_tracing(off, exporter=p0_spans)
    p1 = setup_tracing(ON, exporter=p1_spans)  # would sample everything on its own
    with p0.tracer.start_as_current_span("chat m"):
        carrier = _through_the_wire(inject()).trace_context
    with p1.tracer.start_as_current_span("engine.request", context=extract(carrier)) as span:
        assert not span.is_recording()
    assert p0_spans.get_finished_spans() == () and p1_spans.get_finished_spans() == ()
    flags = int(carrier["traceparent"].rsplit("-", 1)[1], 16)
    assert flags & 0x01 == 0  # the "not sampled" decision travelled


def test_no_current_span_injects_nothing_even_when_on() -> None:
    p0, _, _, _ = _two_processes()
    assert inject() == {}
    with p0.span("chat m"):
        assert set(inject()) >= {"traceparent"}


def test_an_empty_carrier_starts_a_new_trace() -> None:
    _, _, p1, p1_spans = _two_processes()
    with p1.tracer.start_as_current_span("engine.request", context=extract({})):
        pass
    (span,) = p1_spans.get_finished_spans()
    assert span.parent is None


@pytest.mark.parametrize(
    ("name", "count", "attempt", "outcome", "match"),
    [
        ("mm_cache_hit", 1, 1, "x", "not one of"),
        (CACHE_MISS, -1, 1, "x", "hashes_count"),
        (CACHE_MISS, True, 1, "x", "hashes_count"),
        (RETRY, 1, 0, "x", "attempt"),
        (RETRY, 1, 2, "", "outcome"),
    ],
)
def test_cache_event_arguments_are_checked(
    name: str, count: int, attempt: int, outcome: str, match: str
) -> None:
    p0, spans, _, _ = _two_processes()
    with p0.tracer.start_as_current_span("s") as span, pytest.raises(CacheEventError, match=match):
        record_cache_event(span, name, count, attempt, outcome)
    assert spans.get_finished_spans()[0].events == ()


def test_set_global_installs_the_provider_for_library_tracers() -> None:
    code = textwrap.dedent(
        """
        from opentelemetry import trace
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        from mmis.telemetry.tracing import setup_tracing
        from mmis.telemetry.tracing_config import TracingConfig
        spans = InMemorySpanExporter()
        config = TracingConfig(otlp_traces_endpoint="http://127.0.0.1:1")
        setup_tracing(config, exporter=spans, set_global=True)
        with trace.get_tracer("some.library").start_as_current_span("lib"):
            pass
        names = [s.name for s in spans.get_finished_spans()]
        raise SystemExit(0 if names == ["lib"] else f"spans: {names}")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
