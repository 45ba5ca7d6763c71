"""The recovery policy: one retry, with the cache bypassed, before any response byte is sent.

An *attempt* renders the retained :class:`SourcePrompt`, sends one engine request per choice
(``n`` siblings, ids ``<request id>-a<attempt>-<choice>``: fresh per attempt, so a late
output of a dead attempt is never mixed in) and reads their outputs from one queue.

Rules (the drift-recovery chain of docs/ARCHITECTURE.md §2; scenarios S1, S3, S4, S5 in §5):
- A sibling output with ``finish_reason="error"`` and code ``multimodal_cache_miss`` or
  ``engine_restarted`` is *retryable*. On the first attempt it aborts the other siblings
  (exactly one error is handled, however many siblings report one) and starts the second
  attempt, rendered with ``bypass=True`` (every item with data carries it), with ``n``
  choices again.
- Streams may retry only until their first byte: :meth:`RecoveryPolicy.start` returns once
  every sibling produced its first output (the SSE response starts after that). Whole
  responses (:meth:`RecoveryPolicy.complete`) may retry on a failure at any point, since
  nothing was sent yet.
- A retryable failure of the second attempt raises: a miss is the documented 503
  (:class:`MultiModalCacheMissError`), a restart :class:`EngineRestartedError` (503).
- Missing items the client sent by uuid only cannot be healed by P0:
  :class:`HashOnlyCacheMissError` (422) names their uuids, without a retry.
- Non-retryable engine errors map through :func:`from_request_error` (400 / 500).
- Counters: ``mmis_mm_retries_total{endpoint, outcome}``, one per failed first attempt of a
  client request (the readiness probe's are not counted), endpoint as its route, ``outcome``
  ``success`` (the retry produced output), ``failed`` (missed again), ``hash_only`` (refused
  with a 422, never retried), ``error``.
- Traces (no-ops when tracing is off): per attempt a ``render`` span (items, shadow hits,
  bytes sent) and an ``engine`` span (the P0 -> P1 round trip, its context injected into
  every sibling's ``trace_context``), both children of the request's current span. A miss
  is an ``mm_cache_miss`` event on that attempt's ``engine`` span; the queued invalidation
  (``mm_cache_invalidation``) and the retry's outcome (``mm_retry``, attempt 2) are events
  on the logical request span, so a retried request shows both attempts under it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from opentelemetry import trace

from mmis.frontend.engine_client import EngineClient
from mmis.frontend.errors import HashOnlyCacheMissError
from mmis.frontend.generation import (
    RETRYABLE_CODES,
    EngineRestartedError,
    Generation,
    RetryableFailure,
    output_error,
)
from mmis.frontend.renderer import RenderedPrompt, Renderer, SourcePrompt
from mmis.multimodal.cache import item_nbytes
from mmis.protocol.errors import MultiModalCacheMissError
from mmis.protocol.messages import EngineCoreOutput, EngineCoreRequest, ShmAddress
from mmis.telemetry import tracing as tr
from mmis.telemetry.metrics import MMISMetrics
from mmis.telemetry.tracing import Tracing

T = TypeVar("T")

__all__ = [
    "RETRYABLE_CODES",
    "EngineRestartedError",
    "Generation",
    "RecoveryPolicy",
    "RequestBuilder",
    "RetryableFailure",
    "output_error",
]


RENDER_SPAN = "render"
ENGINE_SPAN = "engine"
ATTR_ITEMS = "mmis.mm.items"
ATTR_CACHE_HITS = "mmis.mm.cache_hits"
ATTR_BYTES_SENT = "mmis.mm.bytes_sent"
ATTR_CHOICES = "mmis.choices"
_OFF = Tracing(tracer=trace.NoOpTracer())


def bytes_sent(rendered: RenderedPrompt) -> int:
    """Tensor bytes the features of every copy carry (inline, or written to SHM)."""
    total = 0
    for features in rendered.features:
        for feature in features:
            if isinstance(feature.data, ShmAddress):
                total += feature.data.length
            elif feature.data is not None:
                total += item_nbytes(feature.data)
    return total


ENDPOINT_ROUTES = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
}
RETRY_OUTCOMES = {
    "success": "success",
    "miss_again": "failed",
    "error": "error",
    "hash_only": "hash_only",
}

# (request id, rendered prompt, choice index) -> the engine request of that sibling
RequestBuilder = Callable[[str, RenderedPrompt, int], EngineCoreRequest]
# (choice index, its latest output) -> whether P0 ends that choice here
ChoiceWatch = Callable[[int, EngineCoreOutput], bool]


class RecoveryPolicy:
    def __init__(
        self,
        renderer: Renderer,
        client: EngineClient,
        metrics: MMISMetrics,
        tracing: Tracing | None = None,
    ) -> None:
        self.renderer = renderer
        self.client = client
        self.metrics = metrics
        self.tracing = tracing or _OFF

    async def _attempt(
        self,
        source: SourcePrompt,
        request_id: str,
        attempt: int,
        n: int,
        reserve: int,
        build: RequestBuilder,
    ) -> Generation:
        tracing = self.tracing
        attrs = {tr.ATTR_ATTEMPT: attempt + 1, ATTR_ITEMS: len(source.items)}
        with tracing.span(RENDER_SPAN, attributes=attrs) as render_span:
            rendered = await self.renderer.render(
                source, bypass=attempt > 0, reserve_tokens=reserve, copies=n
            )
            if render_span.is_recording():
                render_span.set_attributes(
                    {ATTR_CACHE_HITS: rendered.shadow_hits, ATTR_BYTES_SENT: bytes_sent(rendered)}
                )
        rids = [f"{request_id}-a{attempt}-{i}" for i in range(n)]
        generation = Generation(self.client, rids)
        generation.rendered = rendered
        generation.span = tracing.start(
            ENGINE_SPAN, attributes={tr.ATTR_ATTEMPT: attempt + 1, ATTR_CHOICES: n}
        )
        carrier = tr.inject(trace.set_span_in_context(generation.span)) if tracing.enabled else {}
        requests = [build(rid, rendered, i) for i, rid in enumerate(rids)]
        for request in requests:
            request.trace_context = dict(carrier)
        try:
            await self.client.add_requests(requests, generation.queue)
        except BaseException:
            generation.end_span()
            raise
        return generation

    async def start(
        self,
        source: SourcePrompt,
        *,
        endpoint: str,
        request_id: str,
        n: int,
        reserve: int,
        build: RequestBuilder,
    ) -> Generation:
        """A generation whose siblings all produced a first output (streams)."""

        async def first(generation: Generation) -> Generation:
            await generation.await_first_outputs()
            return generation

        return await self._run(source, endpoint, request_id, n, reserve, build, first)

    async def complete(
        self,
        source: SourcePrompt,
        *,
        endpoint: str,
        request_id: str,
        n: int,
        reserve: int,
        build: RequestBuilder,
        watch: Callable[[], ChoiceWatch] | None = None,
    ) -> tuple[RenderedPrompt, list[list[EngineCoreOutput]]]:
        """The prompt sent and every output of every choice; retries a failure at any point.

        ``watch`` makes a fresh :data:`ChoiceWatch` per attempt: when it returns True for an
        output (a stop string matched in P0), that choice ends there and is aborted in P1."""

        async def collect(
            generation: Generation,
        ) -> tuple[RenderedPrompt, list[list[EngineCoreOutput]]]:
            per_choice: list[list[EngineCoreOutput]] = [[] for _ in range(n)]
            ends = watch() if watch is not None else None
            async for choice, out in generation.outputs():
                per_choice[choice].append(out)
                if ends is not None and out.finish_reason is None and ends(choice, out):
                    await generation.finish_choice(choice)
            generation.end_span()
            if generation.rendered is None:
                raise RuntimeError("an attempt always records its rendered prompt")
            return generation.rendered, per_choice

        return await self._run(source, endpoint, request_id, n, reserve, build, collect)

    async def _run(
        self,
        source: SourcePrompt,
        endpoint: str,
        request_id: str,
        n: int,
        reserve: int,
        build: RequestBuilder,
        body: Callable[[Generation], Awaitable[T]],
    ) -> T:
        missed = 0  # hashes the first attempt missed
        for attempt in (0, 1):
            try:
                generation = await self._attempt(source, request_id, attempt, n, reserve, build)
            except BaseException:
                if attempt:
                    self._count(endpoint, "error", missed)
                raise
            try:
                result = await body(generation)
            except RetryableFailure as failure:
                self._trace_failure(generation.span, failure.output, attempt)
                missed = len(set(failure.output.missing_mm_hashes))
                await generation.aclose()
                self._on_failure(source, endpoint, failure.output, attempt)
                continue
            except BaseException:
                await generation.aclose()
                if attempt:
                    self._count(endpoint, "error", missed)
                raise
            if attempt:
                self._count(endpoint, "success", missed)
            return result
        raise RuntimeError("unreachable: the second attempt returns or raises")

    def _on_failure(
        self, source: SourcePrompt, endpoint: str, out: EngineCoreOutput, attempt: int
    ) -> None:
        uuids = source.hash_only_uuids(out.missing_mm_hashes)
        if uuids:
            self._count(endpoint, "hash_only", len(uuids), attempt=attempt + 1)
            raise HashOnlyCacheMissError(uuids)
        if attempt == 0:
            return  # the caller retries with the cache bypassed
        self._count(endpoint, "miss_again", len(set(out.missing_mm_hashes)))
        exc = output_error(out)
        if isinstance(exc, MultiModalCacheMissError) and not exc.mm_hashes:
            exc = MultiModalCacheMissError(out.missing_mm_hashes)
        raise exc

    def _count(self, endpoint: str, outcome: str, hashes: int, attempt: int = 2) -> None:
        route = ENDPOINT_ROUTES.get(endpoint)  # the readiness probe is no client request
        if route is not None:
            self.metrics.retry(route, RETRY_OUTCOMES[outcome])
        tr.record_cache_event(trace.get_current_span(), tr.RETRY, hashes, attempt, outcome)

    def _trace_failure(self, span: trace.Span, out: EngineCoreOutput, attempt: int) -> None:
        """The miss on the attempt's span; the invalidation it queued on the request span."""
        missing = len(set(out.missing_mm_hashes))
        if not missing:
            return  # engine_restarted: no cache miss, the retry event tells the story
        outcome = "retrying" if attempt == 0 else "failed"
        tr.record_cache_event(span, tr.CACHE_MISS, missing, attempt + 1, outcome)
        request_span = trace.get_current_span()
        tr.record_cache_event(request_span, tr.CACHE_INVALIDATION, missing, attempt + 1, "queued")
