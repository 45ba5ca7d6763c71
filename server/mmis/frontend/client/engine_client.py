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
- what P1 says the shadow should know besides (the N-shadow invariant of
  ``multimodal/cache.py``) goes the same way, in the batch's order: ``shadow_reset`` to
  ``on_reset`` first (with the epoch change), then the evictions, then the items other P0s
  stored to ``on_stored``; after its handshake the client asks P1 once for what it holds
  (``mm_cache_sync``; an older P1 without it is ignored);
- a request id is used for one attempt only (the caller derives fresh ids per attempt), and
  outputs for ids no longer registered are dropped, so a late output never mixes in;
- the client never blocks the event loop on P1: sends are ZMQ sends awaited on the loop,
  receives are awaited. The codec instance is used from the loop thread only.

Liveness (the link is *up* or *down*: socket monitors, the ``hello`` watchdog, when P1 is
lost and when it is back, :meth:`~EngineLiveness.wait_up`, ``Retry-After``) is the mixin
:class:`~mmis.frontend.client.engine_liveness.EngineLiveness`
(``frontend/client/engine_liveness.py``, whose docstring states those invariants); this class
owns the registrations it acts on:
- while the link is down nothing is sent but ``hello``: requests and other utility calls get
  :class:`EngineUnavailableError` at once; ids released with ``abort`` are aborted once P1
  answers again;
- when the link goes down (:meth:`EngineClient._fail_in_flight`), every registered request
  receives one synthetic retryable ``engine_unavailable`` error and is dropped (its id is
  aborted once P1 answers again), and every pending utility call fails;
- every request remembers the cache epoch it was sent under; if the epoch changes under it
  anyway (a restart faster than the disconnect was seen), it receives a synthetic retryable
  ``engine_restarted`` error; when the client closes, every one still registered receives an
  ``engine_unavailable`` error: no consumer waits forever on a dead engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterable
from typing import Any

import zmq
import zmq.asyncio

from mmis.config import default_of
from mmis.frontend.client.engine_liveness import HELLO, EngineLiveness
from mmis.frontend.config import FrontendConfig
from mmis.frontend.errors import EngineUnavailableError
from mmis.protocol.codec import WireCodec
from mmis.protocol.errors import MMISError
from mmis.protocol.messages import (
    AbortRequests,
    CachedItem,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ErrorCode,
    FinishReason,
    RequestError,
    UtilityCall,
)

log = logging.getLogger(__name__)

MM_CACHE_SYNC = "mm_cache_sync"  # P1's utility call (engine/core_process.py)

OutputQueue = asyncio.Queue[EngineCoreOutput]

__all__ = ["EngineClient", "EngineUnavailableError", "OutputQueue", "error_output"]


class UtilityCallError(MMISError):
    """A utility call the engine answered with an error; ``code`` is the wire
    ``RequestError.code`` (the engine's typed refusal, e.g. ``lora_in_use``, or
    ``utility_failed``): callers switch on it, never on the message."""

    code = ErrorCode.UTILITY_FAILED.value

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @classmethod
    def from_wire(cls, error: RequestError | None) -> UtilityCallError:
        if error is None:
            return cls("utility call failed")
        return cls(error.message, error.code)


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


class EngineClient(EngineLiveness):
    """The client of one P1 engine core (the module's invariants); its liveness half is
    :class:`~mmis.frontend.client.engine_liveness.EngineLiveness`."""

    def __init__(
        self,
        input_address: str,
        output_address: str,
        *,
        client_index: int = 0,
        on_missing: Callable[[list[str]], None] | None = None,
        on_evicted: Callable[[list[str]], None] | None = None,
        on_epoch_change: Callable[[str], None] | None = None,
        on_stored: Callable[[list[CachedItem]], object] | None = None,
        on_reset: Callable[[], None] | None = None,
        ping_interval_s: float = default_of(FrontendConfig, "ping_interval_s"),
        liveness_timeout_s: float = default_of(FrontendConfig, "liveness_timeout_s"),
    ) -> None:
        self.input_address = input_address
        self.output_address = output_address
        self.client_index = client_index
        self.on_missing = on_missing
        self.on_evicted = on_evicted
        self.on_epoch_change = on_epoch_change
        self.on_stored = on_stored
        self.on_reset = on_reset
        self.shadow_resets = 0  # shadow_reset flags received
        self.cache_epoch = ""
        self.engine_info: dict[str, str] = {}  # the model as P1's hello describes it
        self.epoch_changes = 0
        self._init_liveness(ping_interval_s, liveness_timeout_s)
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
    def closed(self) -> bool:
        return self._closed

    async def start(
        self, timeout: float = 60.0, give_up: Callable[[], str | None] | None = None
    ) -> None:
        """Connect and handshake: returns once P1 answered (our subscription is live).
        :class:`EngineUnavailableError` after ``timeout``, or as soon as ``give_up`` returns
        a reason (P1 failed to start). :attr:`engine_info` keeps what ``hello`` said of the
        model (``dtype``, ``device``)."""
        for sock in (self._push, self._sub):
            sock.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        loop = asyncio.get_running_loop()
        self._watch_sockets(loop)  # before connect: sees the first connection
        self._push.connect(self.input_address)
        self._sub.connect(self.output_address)
        self._tasks.append(loop.create_task(self._handle_outputs(), name="mmis-engine-outputs"))
        deadline = loop.time() + timeout
        while True:
            try:
                hello = await self.call_utility(HELLO, timeout=0.25)
                break
            except TimeoutError:
                reason = None if give_up is None else give_up()
                if reason is not None:
                    raise EngineUnavailableError(f"the engine failed to start: {reason}") from None
                if loop.time() > deadline:
                    raise EngineUnavailableError(
                        f"engine at {self.input_address} did not answer within {timeout:.0f}s"
                    ) from None
        self.cache_epoch = str(hello["cache_epoch"])
        info = ("dtype", "device", "block_size", "max_loras")  # max_loras: LoRA on only
        self.engine_info = {k: str(hello[k]) for k in info if k in hello}
        self._handshaken(loop)
        await self._sync_shadow()

    async def _sync_shadow(self) -> None:
        """Ask P1 for what its receiver cache holds (it arrives as a reset and stores)."""
        try:
            await self.call_utility(MM_CACHE_SYNC, timeout=10.0)
        except (UtilityCallError, TimeoutError, EngineUnavailableError) as exc:
            log.info("the engine did not send its cache entries (%s); the shadow starts empty", exc)

    async def close(self) -> None:
        """Stop the tasks, fail whatever is still in flight, close the sockets (idempotent)."""
        if self._closed:
            return
        self._closed = True
        tasks = [*self._tasks, *self._stop_liveness()]  # wakes every wait_up
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for rid, entry in list(self._inflight.items()):
            entry.queue.put_nowait(
                error_output(rid, ErrorCode.ENGINE_UNAVAILABLE.value, "the server is closing")
            )
        self._inflight.clear()
        self._unwatch_sockets()
        self._push.close()
        self._sub.close()
        self._ctx.term()

    # ------------------------------------------------------------------ requests
    async def _send(self, msg: EngineCoreRequest | AbortRequests | UtilityCall) -> None:
        if self._closed:
            raise EngineUnavailableError("the engine client is closed")
        await self._push.send_multipart(self._codec.encode_request(msg), copy=False)

    async def add_requests(self, requests: Iterable[EngineCoreRequest], queue: OutputQueue) -> None:
        """Register every request on ``queue`` (before sending, so no output is missed), send.

        While the link is down nothing is sent: :class:`EngineUnavailableError` (the caller
        waits with :meth:`wait_up` first)."""
        if not self.alive:
            raise self.unavailable()
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
            if not self.alive:  # nothing reaches P1 now: abort them once it answers again
                self._abort_when_up(ids)
                return
            with contextlib.suppress(Exception):
                await self._send(AbortRequests(request_ids=ids, client_index=self.client_index))

    async def call_utility(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        """Call ``method`` in P1; while the link is down only ``hello`` is sent (the others
        fail at once with :class:`EngineUnavailableError`)."""
        if method != HELLO and not self.alive:
            raise self.unavailable()
        call_id, fut = self._new_call()
        try:
            await self._send(UtilityCall(call_id, method, list(args), self.client_index))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)

    def _new_call(self) -> tuple[int, asyncio.Future[Any]]:
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        return call_id, fut

    def _forget_call(self, call_id: int) -> None:
        fut = self._calls.pop(call_id, None)
        if fut is not None and not fut.done():
            fut.cancel()

    def _fail_in_flight(self, reason: str) -> None:
        """The link went down: one ``engine_unavailable`` output per registered request (its
        id is aborted once P1 answers again), every pending utility call fails."""
        log.error("engine lost (%s): failing %d request(s) in flight", reason, len(self._inflight))
        for rid, entry in self._inflight.items():
            entry.queue.put_nowait(error_output(rid, ErrorCode.ENGINE_UNAVAILABLE.value, reason))
        self._abort_when_up(self._inflight)
        self._inflight.clear()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineUnavailableError(reason))

    # ------------------------------------------------------------------ outputs
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
        self._heard_from_engine()
        if batch.cache_epoch and batch.cache_epoch != self.cache_epoch:
            previous, self.cache_epoch = self.cache_epoch, batch.cache_epoch
            if previous:
                self._epoch_changed(previous, batch.cache_epoch)
        if batch.shadow_reset:
            self.shadow_resets += 1
            if self.on_reset is not None:
                self.on_reset()
        if batch.evicted_mm_hashes and self.on_evicted is not None:
            self.on_evicted(batch.evicted_mm_hashes)
        if batch.stored_mm_items and self.on_stored is not None:
            self.on_stored(batch.stored_mm_items)
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
                    fut.set_exception(UtilityCallError.from_wire(res.error))
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
