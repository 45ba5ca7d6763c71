"""One attempt of a request in P1: ``n`` sibling requests sharing one output queue.

A :class:`Generation` is what :class:`~mmis.frontend.client.recovery.RecoveryPolicy` sends
per attempt; it replays buffered outputs, stops single choices, aborts the rest on close, and
turns error outputs into typed exceptions (:func:`output_error`) or, for the retryable codes
(``multimodal_cache_miss``; the engine losses ``engine_unavailable`` and ``engine_restarted``,
made up by ``frontend/client/engine_client.py``), a :class:`RetryableFailure`.

Invariants:
- A sibling is *done* once P1 sent its terminal output (nothing to abort) or P0 stopped it
  (abort sent); :meth:`Generation.aclose` aborts every sibling not done and is idempotent.
- Each output carrying tokens is noted on the request's telemetry record (TTFT / TPOT), and
  the attempt's ``engine`` span ends exactly once (:meth:`Generation.end_span`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from opentelemetry import trace

from mmis.frontend.client.engine_client import EngineClient, OutputQueue
from mmis.frontend.client.renderer import RenderedPrompt
from mmis.frontend.errors import EngineUnavailableError, from_request_error
from mmis.frontend.request_telemetry import current_record
from mmis.protocol.errors import MMISError
from mmis.protocol.messages import EngineCoreOutput, ErrorCode

ENGINE_LOSS_CODES = frozenset(
    {ErrorCode.ENGINE_UNAVAILABLE.value, ErrorCode.ENGINE_RESTARTED.value}
)
RETRYABLE_CODES = frozenset({ErrorCode.MULTIMODAL_CACHE_MISS.value, *ENGINE_LOSS_CODES})


class EngineRestartedError(EngineUnavailableError):
    """P1 restarted (new cache epoch) under a request; 503 with ``Retry-After``, retryable."""

    code = ErrorCode.ENGINE_RESTARTED.value


def is_engine_loss(output: EngineCoreOutput) -> bool:
    """Whether ``output`` is P0's synthetic error for a lost engine (not the request's fault)."""
    return output.error is not None and output.error.code in ENGINE_LOSS_CODES


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
    if err.code == ErrorCode.ENGINE_RESTARTED:
        return EngineRestartedError(f"the engine restarted ({err.message}); retry the request")
    if err.code == ErrorCode.ENGINE_UNAVAILABLE:
        return EngineUnavailableError(f"the engine is unavailable ({err.message}); retry")
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
        self.span: trace.Span = trace.INVALID_SPAN  # the attempt's ``engine`` span
        self.record = current_record()
        self._choice = {rid: i for i, rid in enumerate(self.request_ids)}
        self._buffer: list[EngineCoreOutput] = []
        self._running = set(self.request_ids)  # P1 has not finished them
        self._stopped: set[str] = set()  # P0 stopped them early

    @property
    def n(self) -> int:
        return len(self.request_ids)

    async def _next(self) -> EngineCoreOutput:
        out = await self.queue.get()
        if self.record is not None and out.new_token_ids:
            self.record.on_output(self._choice.get(out.request_id, 0), len(out.new_token_ids))
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

    def end_span(self) -> None:
        """End the attempt's ``engine`` span (idempotent: later calls do nothing)."""
        span, self.span = self.span, trace.INVALID_SPAN
        span.end()

    async def aclose(self) -> None:
        """Abort every sibling P1 still runs (client gone, error, retry); idempotent."""
        self.end_span()
        unfinished, self._running = list(self._running), set()
        await self.client.release(unfinished, abort=True)
        await self.client.release(self.request_ids, abort=False)
