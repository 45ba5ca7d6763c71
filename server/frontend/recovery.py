"""The recovery policy: one retry, with the cache bypassed, before any response byte is sent.

An *attempt* renders the retained :class:`SourcePrompt`, sends one engine request per choice
(``n`` siblings, ids ``<request id>-a<attempt>-<choice>``: fresh per attempt, so a late
output of a dead attempt is never mixed in) and reads their outputs from one queue.

Rules (ARCHITECTURE.md section 2, scenarios S1, S3, S4, S5):
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
- Counters: ``retries{endpoint, outcome}``, one per failed first attempt, ``outcome`` in
  ``success`` (the retry produced output), ``miss_again``, ``hash_only``, ``error``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

from mmis.server.frontend.counters import FrontendCounters
from mmis.server.frontend.engine_client import (
    ENGINE_RESTARTED,
    ENGINE_UNAVAILABLE,
    EngineClient,
    OutputQueue,
)
from mmis.server.frontend.errors import (
    UNAVAILABLE_TYPE,
    FrontendError,
    HashOnlyCacheMissError,
    from_request_error,
)
from mmis.server.frontend.renderer import RenderedPrompt, Renderer, SourcePrompt
from mmis.server.protocol.errors import MMISError, MultiModalCacheMissError
from mmis.server.protocol.messages import EngineCoreOutput, EngineCoreRequest, ErrorCode

T = TypeVar("T")

RETRYABLE_CODES = frozenset({ErrorCode.MULTIMODAL_CACHE_MISS.value, ENGINE_RESTARTED})

# (request id, rendered prompt, choice index) -> the engine request of that sibling
RequestBuilder = Callable[[str, RenderedPrompt, int], EngineCoreRequest]


class EngineRestartedError(FrontendError):
    """P1 restarted under a request twice in a row (or is gone); the client may resend."""

    status = 503
    type = UNAVAILABLE_TYPE
    code = ENGINE_RESTARTED
    retryable = True

    def extra(self) -> dict[str, object]:
        return {"retryable": True}


class RetryableFailure(Exception):
    """A sibling failed in a way the retry heals; :meth:`error` is what the client sees."""

    def __init__(self, output: EngineCoreOutput) -> None:
        super().__init__(output.error.message if output.error else "retryable failure")
        self.output = output

    def error(self) -> BaseException:
        return output_error(self.output)


def output_error(output: EngineCoreOutput) -> BaseException:
    """The typed exception for an error output (retryable ones included)."""
    err = output.error
    if err is None:
        internal = MMISError("the engine failed the request without saying why")
        internal.code = ErrorCode.INTERNAL.value
        return internal
    if err.code in (ENGINE_RESTARTED, ENGINE_UNAVAILABLE):
        return EngineRestartedError(
            f"the engine is restarting or unavailable ({err.message}); retry the request"
        )
    return from_request_error(err, output.missing_mm_hashes)


class Generation:
    """One accepted attempt: ``n`` sibling requests sharing one output queue.

    A sibling is *done* once P1 sent its terminal output (nothing to abort) or P0 stopped it
    (abort sent). Outputs buffered while awaiting the first ones are replayed first.
    """

    def __init__(self, client: EngineClient, request_ids: Sequence[str]) -> None:
        self.client = client
        self.request_ids = list(request_ids)
        self.queue: OutputQueue = asyncio.Queue()
        self.rendered: RenderedPrompt | None = None
        self._choice = {rid: i for i, rid in enumerate(self.request_ids)}
        self._buffer: list[EngineCoreOutput] = []
        self._running = set(self.request_ids)  # P1 has not finished them
        self._stopped: set[str] = set()  # P0 stopped them early

    @property
    def n(self) -> int:
        return len(self.request_ids)

    async def _next(self) -> EngineCoreOutput:
        out = await self.queue.get()
        if out.finish_reason is not None and out.request_id in self._running:
            self._running.discard(out.request_id)
            await self.client.release([out.request_id], abort=False)
        return out

    async def await_first_outputs(self) -> None:
        """Buffer outputs until every sibling produced one; raise on the first error."""
        seen: set[str] = set()
        while len(seen) < self.n:
            out = await self._next()
            self._buffer.append(out)
            seen.add(out.request_id)
            self._check(out)

    def _check(self, out: EngineCoreOutput) -> None:
        if out.finish_reason != "error":
            return
        if out.error is not None and out.error.code in RETRYABLE_CODES:
            raise RetryableFailure(out)
        raise output_error(out)

    async def outputs(self) -> AsyncIterator[tuple[int, EngineCoreOutput]]:
        """``(choice, output)`` in arrival order until every sibling is done."""
        while self._buffer or self._running - self._stopped:
            out = self._buffer.pop(0) if self._buffer else await self._next()
            if out.request_id in self._stopped:
                continue
            self._check(out)
            yield self._choice[out.request_id], out

    async def finish_choice(self, choice: int) -> None:
        """Stop one sibling early (a stop string matched in P0): abort it in P1."""
        rid = self.request_ids[choice]
        self._stopped.add(rid)
        if rid in self._running:
            self._running.discard(rid)
            await self.client.release([rid], abort=True)

    async def aclose(self) -> None:
        """Abort every sibling P1 still runs (client gone, error, retry); idempotent."""
        unfinished, self._running = list(self._running), set()
        await self.client.release(unfinished, abort=True)
        await self.client.release(self.request_ids, abort=False)


class RecoveryPolicy:
    def __init__(
        self, renderer: Renderer, client: EngineClient, counters: FrontendCounters
    ) -> None:
        self.renderer = renderer
        self.client = client
        self.counters = counters

    async def _attempt(
        self,
        source: SourcePrompt,
        request_id: str,
        attempt: int,
        n: int,
        reserve: int,
        build: RequestBuilder,
    ) -> Generation:
        rendered = await self.renderer.render(
            source, bypass=attempt > 0, reserve_tokens=reserve, copies=n
        )
        rids = [f"{request_id}-a{attempt}-{i}" for i in range(n)]
        generation = Generation(self.client, rids)
        generation.rendered = rendered
        requests = [build(rid, rendered, i) for i, rid in enumerate(rids)]
        await self.client.add_requests(requests, generation.queue)
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
    ) -> tuple[RenderedPrompt, list[list[EngineCoreOutput]]]:
        """The prompt sent and every output of every choice; retries a failure at any point."""

        async def collect(
            generation: Generation,
        ) -> tuple[RenderedPrompt, list[list[EngineCoreOutput]]]:
            per_choice: list[list[EngineCoreOutput]] = [[] for _ in range(n)]
            async for choice, out in generation.outputs():
                per_choice[choice].append(out)
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
        for attempt in (0, 1):
            try:
                generation = await self._attempt(source, request_id, attempt, n, reserve, build)
            except BaseException:
                if attempt:
                    self._count(endpoint, "error")
                raise
            try:
                result = await body(generation)
            except RetryableFailure as failure:
                await generation.aclose()
                self._on_failure(source, endpoint, failure.output, attempt)
                continue
            except BaseException:
                await generation.aclose()
                if attempt:
                    self._count(endpoint, "error")
                raise
            if attempt:
                self._count(endpoint, "success")
            return result
        raise RuntimeError("unreachable: the second attempt returns or raises")

    def _on_failure(
        self, source: SourcePrompt, endpoint: str, out: EngineCoreOutput, attempt: int
    ) -> None:
        uuids = source.hash_only_uuids(out.missing_mm_hashes)
        if uuids:
            self._count(endpoint, "hash_only")
            raise HashOnlyCacheMissError(uuids)
        if attempt == 0:
            return  # the caller retries with the cache bypassed
        self._count(endpoint, "miss_again")
        exc = output_error(out)
        if isinstance(exc, MultiModalCacheMissError) and not exc.mm_hashes:
            exc = MultiModalCacheMissError(out.missing_mm_hashes)
        raise exc

    def _count(self, endpoint: str, outcome: str) -> None:
        self.counters.inc("retries", endpoint=endpoint, outcome=outcome)
