"""P0's asynchronous client of one P1 engine core.

Invariants:
- exactly one output-handler task reads P1's outputs and routes them to per-request queues
  and utility futures; several request ids may share one queue (the ``n`` choices of one
  attempt), each output names its request id;
- before an output that reports missing hashes is published to its request, those hashes
  are handed to ``on_missing`` (the pending-invalidation set), so the retry that the
  request's handler starts always renders with the stale shadow entries gone;
- evicted hashes and a changed cache epoch (P1 restarted) are handed to ``on_evicted`` /
  ``on_epoch_change`` before the outputs of the same batch, so drift is prevented, not only
  healed: a restart costs at most one miss per item;
- every request remembers the cache epoch it was sent under; when the epoch changes, each
  one sent under an older epoch receives a synthetic retryable ``engine_restarted`` error
  output (its P1 is gone), and when the client closes, every one still registered receives an
  ``engine_unavailable`` error: no consumer waits forever on a dead engine;
- a request id is used for one attempt only (the caller derives fresh ids per attempt), and
  outputs for ids no longer registered are dropped, so a late output never mixes in;
- a periodic ``hello`` ping keeps :attr:`EngineClient.alive` current for ``/health``;
- the client never blocks the event loop on P1: sends are ZMQ sends awaited on the loop,
  receives are awaited. The codec instance is used from the loop thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import zmq
import zmq.asyncio

from mmis.protocol.codec import WireCodec
from mmis.protocol.errors import MMISError
from mmis.protocol.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ErrorCode,
    FinishReason,
    RequestError,
    UtilityCall,
)

log = logging.getLogger(__name__)

OutputQueue = asyncio.Queue[EngineCoreOutput]


class EngineUnavailableError(MMISError):
    code = ErrorCode.ENGINE_UNAVAILABLE.value
    retryable = True


class UtilityCallError(MMISError):
    code = "utility_failed"


@dataclasses.dataclass
class _InFlight:
    queue: OutputQueue
    epoch: str


def error_output(request_id: str, code: str, message: str) -> EngineCoreOutput:
    """A terminal, retryable error output made up by P0 (the engine never saw it)."""
    return EngineCoreOutput(
        request_id=request_id,
        finish_reason=FinishReason.ERROR.value,
        error=RequestError(code=code, message=message, retryable=True),
    )


class EngineClient:
    def __init__(
        self,
        input_address: str,
        output_address: str,
        *,
        client_index: int = 0,
        on_missing: Callable[[list[str]], None] | None = None,
        on_evicted: Callable[[list[str]], None] | None = None,
        on_epoch_change: Callable[[str], None] | None = None,
        ping_interval_s: float = 2.0,
        liveness_timeout_s: float = 10.0,
    ) -> None:
        self.input_address = input_address
        self.output_address = output_address
        self.client_index = client_index
        self.on_missing = on_missing
        self.on_evicted = on_evicted
        self.on_epoch_change = on_epoch_change
        self.ping_interval_s = ping_interval_s
        self.liveness_timeout_s = liveness_timeout_s
        self.cache_epoch = ""
        self.last_pong = 0.0
        self.epoch_changes = 0
        self._codec = WireCodec()
        self._ctx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._sub = self._ctx.socket(zmq.SUB)
        self._inflight: dict[str, _InFlight] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    @property
    def _topic(self) -> bytes:
        return b"c%d" % self.client_index

    @property
    def num_in_flight(self) -> int:
        """Request ids registered and not yet released (0 when nothing leaks)."""
        return len(self._inflight)

    @property
    def alive(self) -> bool:
        """Whether P1 answered a ping within ``liveness_timeout_s``."""
        return not self._closed and time.monotonic() - self.last_pong < self.liveness_timeout_s

    async def start(self, timeout: float = 60.0) -> None:
        """Connect and handshake: returns once P1 answered (our subscription is live)."""
        for sock in (self._push, self._sub):
            sock.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._push.connect(self.input_address)
        self._sub.connect(self.output_address)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._handle_outputs(), name="mmis-engine-outputs"))
        deadline = loop.time() + timeout
        while True:
            try:
                hello = await self.call_utility("hello", timeout=0.25)
                break
            except TimeoutError:
                if loop.time() > deadline:
                    raise EngineUnavailableError(
                        f"engine at {self.input_address} did not answer within {timeout:.0f}s"
                    ) from None
        self.cache_epoch = str(hello["cache_epoch"])
        self.last_pong = time.monotonic()
        self._tasks.append(loop.create_task(self._ping_loop(), name="mmis-engine-ping"))

    async def close(self) -> None:
        """Stop the tasks, fail whatever is still in flight, close the sockets (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for rid, entry in list(self._inflight.items()):
            entry.queue.put_nowait(
                error_output(rid, ErrorCode.ENGINE_UNAVAILABLE.value, "the server is closing")
            )
        self._inflight.clear()
        self._push.close()
        self._sub.close()
        self._ctx.term()

    # ------------------------------------------------------------------ requests
    async def _send(self, msg: EngineCoreRequest | AbortRequests | UtilityCall) -> None:
        if self._closed:
            raise EngineUnavailableError("the engine client is closed")
        await self._push.send_multipart(self._codec.encode_request(msg), copy=False)

    async def add_requests(self, requests: Iterable[EngineCoreRequest], queue: OutputQueue) -> None:
        """Register every request on ``queue`` (before sending, so no output is missed), send."""
        batch = list(requests)
        for request in batch:
            if request.request_id in self._inflight:
                raise ValueError(f"request id {request.request_id!r} is already in flight")
            request.client_index = self.client_index
            self._inflight[request.request_id] = _InFlight(queue, self.cache_epoch)
        try:
            for request in batch:
                await self._send(request)
        except BaseException:
            await self.release([r.request_id for r in batch], abort=True)
            raise

    async def release(self, request_ids: Iterable[str], *, abort: bool) -> None:
        """Forget ``request_ids``; with ``abort``, also tell P1 to stop the ones it runs."""
        ids = [rid for rid in request_ids if self._inflight.pop(rid, None) is not None]
        if abort and ids and not self._closed:
            with contextlib.suppress(Exception):
                await self._send(AbortRequests(request_ids=ids, client_index=self.client_index))

    async def call_utility(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            await self._send(UtilityCall(call_id, method, list(args), self.client_index))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)

    # ------------------------------------------------------------------ outputs
    async def _ping_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ping_interval_s)  # a period, not a synchronisation
            with contextlib.suppress(TimeoutError, MMISError):
                await self.call_utility("hello", timeout=self.liveness_timeout_s)

    async def _handle_outputs(self) -> None:
        while True:
            frames = await self._sub.recv_multipart(copy=False)
            try:
                batch = self._codec.decode_outputs([f.buffer for f in frames[1:]])
            except MMISError as exc:
                log.error("dropped an undecodable engine output: %s", exc)
                continue
            try:
                self._dispatch(batch)
            except Exception:  # one bad batch must not kill the only reader
                log.exception("failed to dispatch an engine output batch")

    def _dispatch(self, batch: EngineCoreOutputs) -> None:
        self.last_pong = time.monotonic()
        if batch.cache_epoch and batch.cache_epoch != self.cache_epoch:
            previous, self.cache_epoch = self.cache_epoch, batch.cache_epoch
            if previous:
                self._epoch_changed(previous, batch.cache_epoch)
        if batch.evicted_mm_hashes and self.on_evicted is not None:
            self.on_evicted(batch.evicted_mm_hashes)
        missing = [h for out in batch.outputs for h in out.missing_mm_hashes]
        if missing and self.on_missing is not None:
            self.on_missing(missing)  # before any output of this batch is published
        if batch.utility_result is not None:
            res = batch.utility_result
            fut = self._calls.get(res.call_id)
            if fut is not None and not fut.done():
                if res.ok:
                    fut.set_result(res.result)
                else:
                    msg = res.error.message if res.error else "utility call failed"
                    fut.set_exception(UtilityCallError(msg))
        for out in batch.outputs:
            entry = self._inflight.get(out.request_id)
            if entry is not None:
                entry.queue.put_nowait(out)

    def _epoch_changed(self, previous: str, current: str) -> None:
        log.warning("engine cache epoch changed (%s -> %s): P1 restarted", previous, current)
        self.epoch_changes += 1
        if self.on_epoch_change is not None:
            self.on_epoch_change(current)
        for rid, entry in list(self._inflight.items()):
            if entry.epoch != current:
                entry.epoch = current  # one synthetic error per request, never two
                entry.queue.put_nowait(
                    error_output(
                        rid, ErrorCode.ENGINE_RESTARTED.value, "the engine restarted; retrying"
                    )
                )
