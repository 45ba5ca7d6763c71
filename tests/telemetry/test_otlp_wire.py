"""otlp_wire and protobuf_fields write the very bytes the OpenTelemetry SDK encoder writes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from opentelemetry import propagate, trace
from opentelemetry.exporter.otlp.proto.common._internal import _encode_value
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, Status, StatusCode

from mmis.telemetry import otlp_wire, protobuf_fields
from mmis.telemetry.otlp_wire import Encoder
from mmis.telemetry.tracing import setup_tracing
from mmis.telemetry.tracing_config import TracingConfig

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _provider(
    service: str, limits: SpanLimits | None = None
) -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(
        resource=Resource.create({"service.name": service, "mmis.pod": "p-0", "n": 3}),
        span_limits=limits,
    )
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _varied_spans() -> Sequence[ReadableSpan]:
    p0, p0_out = _provider("mmis-frontend")
    p1, p1_out = _provider(
        "mmis-engine", SpanLimits(max_span_attributes=2, max_events=1, max_links=1)
    )
    plain = p0.get_tracer("mmis")
    versioned = p0.get_tracer("mmis.x", "1.2.3", schema_url="https://opentelemetry.io/schemas/1.21.0",
                              attributes={"scope.attr": True})  # fmt: skip
    attrs: dict[str, Any] = {
        "s": "POST /v1/chat/completions", "empty": "", "unicode": "naïve ✓", "t": True,
        "f": False, "zero": 0, "neg": -5, "big": 2**62, "too_big": 2**70, "float": 0.25,
        "nan": float("nan"), "strs": ("a", "b"), "ints": (1, -2, 3), "bools": (True,),
        "floats": (1.5, 0.0), "none_in": ("a", None), "empty_seq": (),
    }  # fmt: skip
    with plain.start_as_current_span("root", kind=trace.SpanKind.SERVER, attributes=attrs) as root:
        root.add_event("mm_cache_miss", {"mmis.mm.hashes_count": 2, "mmis.mm.outcome": "retry"})
        root.add_event("bare")
        with versioned.start_as_current_span("child", kind=trace.SpanKind.CLIENT) as child:
            child.set_status(Status(StatusCode.ERROR, "engine said no"))
        link = Link(root.get_span_context(), {"why": "sibling"})
        with plain.start_as_current_span("linked", links=[link]) as linked:
            linked.set_status(Status(StatusCode.OK))
    remote = propagate.extract({"traceparent": TRACEPARENT, "tracestate": "mmis=1,other=x"})
    tracer = p1.get_tracer("mmis")
    with tracer.start_as_current_span("engine_core", context=remote, attributes=attrs) as span:
        span.add_event("one")
        span.add_event("two")  # beyond max_events: dropped and counted
    for kind in (trace.SpanKind.PRODUCER, trace.SpanKind.CONSUMER, trace.SpanKind.INTERNAL):
        tracer.start_span(f"kind-{kind.name}", kind=kind, links=[link, link]).end()
    return [*p0_out.get_finished_spans(), *p1_out.get_finished_spans()]


def test_a_batch_of_varied_spans_encodes_to_the_sdk_encoders_bytes() -> None:
    spans = _varied_spans()
    expected = encode_spans(spans).SerializeToString()
    assert Encoder().encode_request(spans) == expected
    # interleaved resources and scopes group the same way (first seen first)
    mixed = [spans[-1], *spans[:-1]]
    assert Encoder().encode_request(mixed) == encode_spans(mixed).SerializeToString()


def test_cached_headers_and_key_values_give_the_same_bytes_on_every_batch() -> None:
    spans = _varied_spans()
    encoder = Encoder()
    first = encoder.encode_request(spans)
    assert encoder.encode_request(spans) == first
    assert encoder.encode_request(spans[:1]) == encode_spans(spans[:1]).SerializeToString()


@pytest.mark.parametrize(
    "value",
    [None, "", "x", True, False, 0, 1, 127, 128, 300, -1, -(2**63), 2**63 - 1, 0.0, -2.5,
     b"", b"\x00\xff", (), ("a", 1, True, 2.0), (("nested",),), {"k": 1, "m": {"n": "o"}}],
)  # fmt: skip
def test_any_value_matches_the_sdk(value: object) -> None:
    assert protobuf_fields.any_value(value) == _encode_value(value).SerializeToString()


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, object()])
def test_a_value_protobuf_cannot_hold_is_refused_like_the_sdk(value: object) -> None:
    with pytest.raises(Exception):  # noqa: B017 - the SDK raises ValueError or a bare Exception
        _encode_value(value)
    with pytest.raises((TypeError, ValueError)):
        protobuf_fields.any_value(value)
    # inside an attribute map it is skipped, as the SDK skips it
    assert protobuf_fields.attributes(otlp_wire.SPAN_ATTRS, {"bad": value, "ok": 1}) == (
        protobuf_fields.attributes(otlp_wire.SPAN_ATTRS, {"ok": 1})
    )


@pytest.mark.parametrize("n", [0, 1, 127, 128, 16383, 16384, 2**32, 2**63 - 1])
def test_varint_is_leb128(n: int) -> None:
    encoded = protobuf_fields.varint(n)
    decoded, shift = 0, 0
    for i, byte in enumerate(encoded):
        decoded |= (byte & 0x7F) << shift
        shift += 7
        assert (byte & 0x80 != 0) == (i < len(encoded) - 1)
    assert decoded == n


def test_finished_children_recorded_without_a_live_span_encode_like_the_sdk() -> None:
    exporter = InMemorySpanExporter()
    tracing = setup_tracing(TracingConfig(), exporter=exporter)
    root = tracing.start("engine_core", start_time=1_000)
    tracing.record_finished(root, "queue", 1_000, 2_000)
    tracing.record_finished(root, "encoder", 2_000, 3_000, {"mmis.encoder.items": 2})
    root.end(end_time=4_000)
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["queue", "encoder", "engine_core"]
    assert Encoder().encode_request(spans) == encode_spans(spans).SerializeToString()
