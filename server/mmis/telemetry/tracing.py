"""OpenTelemetry tracing: setup, P0 -> P1 context propagation, cache span events.

Invariants:
- Off (no endpoint configured, see :mod:`tracing_config`) costs nothing: the tracer is the
  API's ``NoOpTracer``, the SDK is not even imported, no provider, processor or exporter
  exists, :meth:`Tracing.span` hands out one shared no-op context manager (no span object,
  no context switch) and :func:`inject` returns an empty carrier at once.
- On: one SDK ``TracerProvider`` per :func:`setup_tracing` call, sampled
  ``ParentBased(TraceIdRatioBased(ratio))`` (or the bare ratio sampler when the environment
  asked for a non-parent-based one), exporting over OTLP gRPC or HTTP with a batch processor.
  The gRPC exporter encodes with :mod:`otlp_wire` (same bytes, a third of the CPU); the HTTP
  one is the SDK's as it is.
  The global provider is set only when asked (``set_global=True``), so tests and a P1
  stand-in can each hold their own provider.
- Propagation uses the globally configured text-map propagator (W3C trace context and
  baggage unless ``OTEL_PROPAGATORS`` says otherwise): P0 puts :func:`inject`'s dict into
  ``EngineCoreRequest.trace_context``; P1 passes it to :func:`extract` and starts its spans
  under the returned context.
- Cache events carry counts, never hashes: :func:`record_cache_event` is the one way to add
  ``mm_cache_miss`` / ``mm_cache_invalidation`` / ``mm_retry`` events, and it does nothing on
  a non-recording span.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

from opentelemetry import propagate, trace
from opentelemetry.context import Context

from mmis.telemetry.errors import CacheEventError
from mmis.telemetry.genai import AttributeValue
from mmis.telemetry.tracing_config import TracingConfig

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

TRACER_NAME = "mmis"

CACHE_MISS = "mm_cache_miss"
CACHE_INVALIDATION = "mm_cache_invalidation"
RETRY = "mm_retry"
CACHE_EVENTS = frozenset({CACHE_MISS, CACHE_INVALIDATION, RETRY})

ATTR_HASHES_COUNT = "mmis.mm.hashes_count"
ATTR_ATTEMPT = "mmis.mm.attempt"
ATTR_OUTCOME = "mmis.mm.outcome"

_NO_SPAN: contextlib.AbstractContextManager[trace.Span] = contextlib.nullcontext(trace.INVALID_SPAN)


@dataclasses.dataclass(frozen=True)
class Tracing:
    """What :func:`setup_tracing` built: a tracer and, when on, the SDK provider behind it."""

    tracer: trace.Tracer
    provider: TracerProvider | None = None
    processor: SpanProcessor | None = None  # the one processor setup_tracing attached

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def span(
        self,
        name: str,
        *,
        context: Context | None = None,
        kind: trace.SpanKind = trace.SpanKind.INTERNAL,
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> contextlib.AbstractContextManager[trace.Span]:
        """Start a span and make it current; when off, a shared no-op (no context switch)."""
        if self.provider is None:
            return _NO_SPAN
        return self.tracer.start_as_current_span(
            name, context=context, kind=kind, attributes=attributes
        )

    def start(
        self,
        name: str,
        *,
        context: Context | None = None,
        kind: trace.SpanKind = trace.SpanKind.INTERNAL,
        attributes: Mapping[str, AttributeValue] | None = None,
        start_time: int | None = None,
    ) -> trace.Span:
        """Start a span that is NOT made current (the caller ends it); off: the invalid span."""
        if self.provider is None:
            return trace.INVALID_SPAN
        return self.tracer.start_span(
            name, context=context, kind=kind, attributes=attributes, start_time=start_time
        )

    def record_finished(
        self,
        parent: trace.Span,
        name: str,
        start_time: int,
        end_time: int,
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> None:
        """Record an INTERNAL child of ``parent`` that already ran from ``start_time`` to
        ``end_time`` (P1's phases, known only afterwards).

        It is handed straight to the processor as a finished span: no live span, no sampler
        call (a child shares its parent's decision: ``parent`` not recording -> nothing),
        about a fifth of a live span's cost. Off: nothing.
        """
        if self.provider is None or self.processor is None or not parent.is_recording():
            return
        from opentelemetry.sdk.trace import ReadableSpan

        up = parent.get_span_context()
        context = trace.SpanContext(
            up.trace_id,
            self.provider.id_generator.generate_span_id(),
            is_remote=False,
            trace_flags=up.trace_flags,
            trace_state=up.trace_state,
        )
        span = ReadableSpan(
            name,
            context=context,
            parent=up,
            resource=self.provider.resource,
            attributes=dict(attributes or {}),
            start_time=start_time,
            end_time=end_time,
            instrumentation_scope=getattr(parent, "instrumentation_scope", None),
        )
        self.processor.on_end(span)

    def force_flush(self, timeout_ms: int = 5000) -> bool:
        return True if self.provider is None else self.provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


def setup_tracing(
    config: TracingConfig,
    *,
    exporter: SpanExporter | None = None,
    set_global: bool = False,
) -> Tracing:
    """Build tracing from ``config``; ``exporter`` (tests) replaces the OTLP one and forces on.

    An injected exporter gets a synchronous processor, so its spans are visible as soon as
    they end; the OTLP exporters get a batch processor.
    """
    if exporter is None and not config.enabled:
        return Tracing(tracer=trace.NoOpTracer())

    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased

    ratio: Sampler = TraceIdRatioBased(config.sampling_ratio)
    provider = TracerProvider(
        sampler=ParentBased(ratio) if config.parent_based else ratio,
        resource=Resource.create({SERVICE_NAME: config.service_name}),
    )
    processor: SpanProcessor
    if exporter is not None:
        processor = SimpleSpanProcessor(exporter)
    else:
        processor = BatchSpanProcessor(otlp_exporter(config))
    provider.add_span_processor(processor)
    if set_global:
        trace.set_tracer_provider(provider)
    return Tracing(tracer=provider.get_tracer(TRACER_NAME), provider=provider, processor=processor)


def otlp_exporter(config: TracingConfig) -> SpanExporter:
    """The OTLP span exporter for ``config``'s protocol and endpoint (connects lazily)."""
    endpoint = config.otlp_traces_endpoint
    if config.protocol == "grpc":
        from mmis.telemetry.grpc_exporter import GrpcSpanExporter

        return GrpcSpanExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter(endpoint=endpoint)


def inject(context: Context | None = None) -> dict[str, str]:
    """The current (or given) trace context as a carrier for ``EngineCoreRequest.trace_context``.

    Empty when there is no valid span to continue (tracing off, or no span started): then
    nothing, not even baggage, crosses to P1.
    """
    if not trace.get_current_span(context).get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier


def extract(carrier: Mapping[str, str] | None) -> Context:
    """The context P0 sent; an empty or missing carrier gives a context with no parent."""
    return propagate.extract(dict(carrier or {}))


def record_cache_event(
    span: trace.Span, name: str, hashes_count: int, attempt: int, outcome: str
) -> None:
    """Add a multimodal-cache event (miss, invalidation, retry) to ``span``.

    ``hashes_count``: how many items it concerns; ``attempt``: 1 for the first try, 2 for the
    retry; ``outcome``: what happened (e.g. ``retrying``, ``success``, ``failed``).
    """
    if name not in CACHE_EVENTS:
        raise CacheEventError(f"cache event {name!r} is not one of {sorted(CACHE_EVENTS)}")
    if isinstance(hashes_count, bool) or not isinstance(hashes_count, int) or hashes_count < 0:
        raise CacheEventError(f"hashes_count must be an int >= 0, got {hashes_count!r}")
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
        raise CacheEventError(f"attempt must be an int >= 1, got {attempt!r}")
    if not outcome:
        raise CacheEventError("a cache event needs an outcome")
    if not span.is_recording():
        return
    span.add_event(
        name,
        {ATTR_HASHES_COUNT: hashes_count, ATTR_ATTEMPT: attempt, ATTR_OUTCOME: outcome},
    )
