"""The recovery policy: one retry, with the cache bypassed, before any response byte is sent.

An *attempt* renders the retained :class:`SourcePrompt`, sends one engine request per choice
(``n`` siblings, ids ``<request id>-a<attempt>-<choice>``: fresh per attempt, so a late
output of a dead attempt is never mixed in) and reads their outputs from one queue.

Rules (the drift-recovery chain of docs/ARCHITECTURE.md §2; scenarios S1, S3, S4, S5 in §5):
- A sibling output with ``finish_reason="error"`` and code ``multimodal_cache_miss`` is a
  *drift failure*. The first one aborts the other siblings (exactly one error is handled,
  however many siblings report one) and starts the drift retry, rendered with ``bypass=True``
  (every item with data carries it), with ``n`` choices again. A request has one drift retry.
- Streams may retry only until their first byte: :meth:`RecoveryPolicy.start` returns once
  every sibling produced its first output (the SSE response starts after that). Whole
  responses (:meth:`RecoveryPolicy.complete`) may retry on a failure at any point, since
  nothing was sent yet.
- A drift failure after the drift retry raises the documented 503
  (:class:`MultiModalCacheMissError`).

Engine losses (P1 crashed, restarted or hung; ``frontend/client/engine_client.py`` fails the
attempt with a synthetic ``engine_unavailable`` / ``engine_restarted`` output) are not drift:
- **They never spend the drift retry, and the drift retry never spends theirs.** After a loss
  the request waits until P1 answers again, then renders again with the bypass it had (on the
  drift retry: still bypassed). A restarted P1 announces a new cache epoch, which empties the
  shadow before that render (the epoch change is handled before the link is up), so every
  item goes with its data and cannot miss; a P1 that only stalled kept its cache. Either way a
  miss on the healed attempt still has the one drift retry, if unspent: an engine loss cannot
  make a healable request fail.
- **One loss is healed per request**; the second raises its retryable 503 (a request that
  takes P1 down each time it runs must not crash-loop the engine).
- **Waiting is bounded**: every wait for P1 (before an attempt, after a loss) ends by
  ``engine_wait_s`` after the request's first wait began, then
  :class:`~mmis.frontend.errors.EngineUnavailableError` (503, ``Retry-After``).
  With ``fail_fast`` there is no wait: a loss, or P1 down when an attempt is about to start,
  is that 503 at once, so a gateway sends the request to another replica.
- Loss retries are not counted in ``mmis_mm_retries_total`` (that is the drift retry's).
- Missing items the client sent by uuid only cannot be healed by P0:
  :class:`HashOnlyCacheMissError` (422) names their uuids, without a retry. That answer is
  the only place a uuid goes: spans and their events carry counts, never a uuid.
- **A failed send undoes the render's record**: when an attempt's engine requests cannot be
  built or sent after its render recorded items in the shadow, the shadow forgets the items
  that render recorded with their data (:meth:`Renderer.forget`), so the next request with
  them sends their data rather than a shadow hit P1 would miss.
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

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import TypeVar

from opentelemetry import trace

from mmis.frontend.client.engine_client import EngineClient
from mmis.frontend.client.generation import (
    RETRYABLE_CODES,
    EngineRestartedError,
    Generation,
    RetryableFailure,
    is_engine_loss,
    output_error,
)
from mmis.frontend.client.renderer import RenderedPrompt, Renderer, SourcePrompt
from mmis.frontend.errors import EngineUnavailableError, HashOnlyCacheMissError
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
ATTR_MISSING = "mmis.mm.missing_items"
MAX_ENGINE_LOSSES = 1  # engine losses healed per request
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
    "responses": "/v1/responses",
}
RETRY_OUTCOMES = {
    "success": "success",
    "miss_again": "failed",
    "error": "error",
    "hash_only": "hash_only",
}

# (request id, rendered prompt, choice index) -> the engine request of that sibling. Both
# callables are the client's own (``output_processor.py``, the readiness probe of
# ``frontend/state.py``): ``api`` hands the client data only (issue 45).
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
        *,
        fail_fast: bool = False,
        engine_wait_s: float = 60.0,
    ) -> None:
        self.renderer = renderer
        self.client = client
        self.metrics = metrics
        self.tracing = tracing or _OFF
        self.fail_fast = fail_fast
        self.engine_wait_s = engine_wait_s

    async def _attempt(
        self,
        source: SourcePrompt,
        request_id: str,
        attempt: int,
        n: int,
        reserve: int,
        build: RequestBuilder,
        bypass: bool,
    ) -> Generation:
        tracing = self.tracing
        attrs = {tr.ATTR_ATTEMPT: attempt + 1, ATTR_ITEMS: len(source.items)}
        hash_only: HashOnlyCacheMissError | None = None
        with tracing.span(RENDER_SPAN, attributes=attrs) as render_span:
            try:
                rendered = await self.renderer.render(
                    source, bypass=bypass, reserve_tokens=reserve, copies=n
                )
            except HashOnlyCacheMissError as exc:  # its message names uuids: not on the span
                hash_only = exc
                render_span.set_status(
                    trace.Status(trace.StatusCode.ERROR, f"{exc.code}: uuid-only item(s) missing")
                )
                render_span.set_attribute(ATTR_MISSING, len(exc.missing_uuids))
            else:
                if render_span.is_recording():
                    render_span.set_attributes(
                        {
                            ATTR_CACHE_HITS: rendered.shadow_hits,
                            ATTR_BYTES_SENT: bytes_sent(rendered),
                        }
                    )
        if hash_only is not None:
            raise hash_only
        rids = [f"{request_id}-a{attempt}-{i}" for i in range(n)]
        generation = Generation(self.client, rids)
        generation.rendered = rendered
        generation.span = tracing.start(
            ENGINE_SPAN, attributes={tr.ATTR_ATTEMPT: attempt + 1, ATTR_CHOICES: n}
        )
        carrier = tr.inject(trace.set_span_in_context(generation.span)) if tracing.enabled else {}
        try:
            requests = [build(rid, rendered, i) for i, rid in enumerate(rids)]
            for request in requests:
                request.trace_context = dict(carrier)
            await self.client.add_requests(requests, generation.queue)
        except BaseException:
            self.renderer.forget(rendered)  # nothing (or not all) reached P1
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
        missed = 0  # hashes the failed attempt before the drift retry missed
        drift_retried = False
        losses = 0
        loop = asyncio.get_running_loop()
        wait_deadline: float | None = None  # set by the request's first wait for P1
        for attempt in itertools.count():
            try:
                if not self.client.alive:
                    if self.fail_fast:
                        raise self.client.unavailable()
                    if wait_deadline is None:
                        wait_deadline = loop.time() + self.engine_wait_s
                    await self.client.wait_up(max(wait_deadline - loop.time(), 0.0))
                generation = await self._attempt(
                    source, request_id, attempt, n, reserve, build, bypass=drift_retried
                )
            except EngineUnavailableError:
                waited_out = wait_deadline is not None and loop.time() >= wait_deadline
                if self.fail_fast or waited_out or self.client.closed or self.client.alive:
                    if drift_retried:
                        self._count(endpoint, "error", missed)
                    raise
                if wait_deadline is None:
                    wait_deadline = loop.time() + self.engine_wait_s
                continue  # P1 went down during the render, nothing was sent: wait for it
            except BaseException:
                if drift_retried:
                    self._count(endpoint, "error", missed)
                raise
            try:
                result = await body(generation)
            except RetryableFailure as failure:
                out = failure.output
                if not is_engine_loss(out):
                    self._trace_failure(generation.span, out, int(drift_retried))
                await generation.aclose()
                if is_engine_loss(out):
                    losses += 1
                    if self.fail_fast or losses > MAX_ENGINE_LOSSES:
                        if drift_retried:
                            self._count(endpoint, "error", missed)
                        raise self._loss_error(out) from None
                    continue  # the next turn waits for P1, then renders again
                missed = len(set(out.missing_mm_hashes))
                self._on_failure(source, endpoint, out, int(drift_retried))
                drift_retried = True
                continue
            except BaseException:
                await generation.aclose()
                if drift_retried:
                    self._count(endpoint, "error", missed)
                raise
            if drift_retried:
                self._count(endpoint, "success", missed)
            return result
        raise RuntimeError("unreachable: the attempts loop returns or raises")

    def _loss_error(self, out: EngineCoreOutput) -> BaseException:
        """The 503 for a loss that is not healed, with this client's ``Retry-After``."""
        exc = output_error(out)
        if isinstance(exc, EngineUnavailableError):
            exc.retry_after_s = self.client.retry_after_s
        return exc

    def _on_failure(
        self, source: SourcePrompt, endpoint: str, out: EngineCoreOutput, attempt: int
    ) -> None:
        """A drift failure; ``attempt`` is 0 before the drift retry, 1 on it."""
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
            return  # no hash named: nothing to trace
        outcome = "retrying" if attempt == 0 else "failed"
        tr.record_cache_event(span, tr.CACHE_MISS, missing, attempt + 1, outcome)
        request_span = trace.get_current_span()
        tr.record_cache_event(request_span, tr.CACHE_INVALIDATION, missing, attempt + 1, "queued")
