"""P0's asynchronous client of one P1 engine core, and its view of P1's liveness.

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
- a request id is used for one attempt only (the caller derives fresh ids per attempt), and
  outputs for ids no longer registered are dropped, so a late output never mixes in;
- the client never blocks the event loop on P1: sends are ZMQ sends awaited on the loop,
  receives are awaited. The codec instance is used from the loop thread only.

Liveness (the link is *up* or *down*; :attr:`EngineClient.alive` is ``/health`` and half of
``/ready``, see ``frontend/state.py``):
- **A crash is seen at once.** A ZMQ socket monitor on both sockets reports the peer's
  disconnect the moment the kernel closes P1's end (process gone: SIGKILL, OOM kill, exit);
  no heartbeat is needed for that, and it takes milliseconds, not a timeout.
- **A hang is seen within a bound.** Every ``ping_interval_s`` the watchdog sends a ``hello``
  (answered by P1's *input* thread, ``engine/core_process.py``, so a long prefill on the busy
  loop never delays it); any batch from P1 counts as an answer. The link goes down when a
  ping has waited ``liveness_timeout_s`` with nothing heard from P1 since it was sent: between
  ``liveness_timeout_s - ping_interval_s`` and ``liveness_timeout_s + ping_interval_s`` after
  P1 fell silent. A loaded P0 is not mistaken for a hung P1: silence is counted from a ping
  actually sent (a blocked loop sends none), and not while a message from P1 waits unread in
  our SUB socket (our loop is behind, P1 is not silent). What a ``hello`` cannot see is a busy
  loop stuck while the input thread runs; the engine container's liveness probe (Kubernetes)
  owns that case.
- **Going down** fails every registered request at once with one synthetic retryable
  ``engine_unavailable`` error output (the registration is dropped, so nothing of the dead
  attempt can follow), fails every pending utility call, and refuses new sends
  (:class:`EngineUnavailableError`) until the link is up again; the ids are remembered.
- A dead P1 drops both sockets: after a disconnect, only an answer read once *both* sockets
  reconnected brings the link up (a dying P1 may still answer a ``hello`` on its way out, and
  the two monitors are read independently), so one death is one loss and one heal.
- **Coming back** needs a ``hello`` answered after the sockets reconnected (a restarted P1)
  or after the silence ended (a stopped P1 continued). Its batch runs the epoch-change path
  first (a restarted P1 has a new cache epoch: the shadow is dropped before any new render),
  then the link is up, waiters of :meth:`EngineClient.wait_up` resume, and one abort of the
  remembered ids goes out (a P1 that was only stalled, or a request queued in the socket when
  P1 died, must not run for nobody).
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
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from mmis.config import default_of
from mmis.frontend.config import FrontendConfig
from mmis.frontend.errors import EngineUnavailableError
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

__all__ = ["EngineClient", "EngineUnavailableError", "OutputQueue", "error_output"]

HELLO = "hello"
RECONNECT_PING_S = 0.1  # ping period while the sockets are connected but P1 has not answered
MAX_RETRY_AFTER_S = 30.0
_MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


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
        ping_interval_s: float = default_of(FrontendConfig, "ping_interval_s"),
        liveness_timeout_s: float = default_of(FrontendConfig, "liveness_timeout_s"),
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
        self.last_pong = 0.0  # monotonic time of P1's latest batch
        self._asked_at: float | None = None  # the first ping sent after P1's latest batch
        self.epoch_changes = 0
        self.losses = 0  # times the link went down after being up
        self.down_since: float | None = None  # monotonic; None while up (or never up yet)
        self.down_reason = "the engine has not answered yet"
        self._last_outage_s = 0.0
        self._codec = WireCodec()
        self._ctx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._sub = self._ctx.socket(zmq.SUB)
        self._connected = {"input": False, "output": False}
        # sockets that must reconnect before an answer may bring the link up (P1 died)
        self._must_reconnect: set[str] = set()
        self._up = asyncio.Event()
        self._wake = asyncio.Event()  # a socket connected: ping now
        self._reconnected = False  # a socket connected again while the link was down
        self._oneshots: set[asyncio.Task[None]] = set()
        self._orphans: set[str] = set()  # ids failed by a loss; aborted once P1 answers again
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
        """Whether the link is up: P1 handshaked, its sockets are connected and it answered
        within ``liveness_timeout_s`` (the watchdog keeps this current)."""
        return not self._closed and self._up.is_set()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def retry_after_s(self) -> int:
        """Seconds a client should wait before retrying while P1 is down: the previous
        outage's length minus the time this one has lasted, within [1, 30]."""
        elapsed = 0.0 if self.down_since is None else time.monotonic() - self.down_since
        guess = min(max(self._last_outage_s - elapsed, 1.0), MAX_RETRY_AFTER_S)
        return math.ceil(guess)

    def unavailable(self, message: str | None = None) -> EngineUnavailableError:
        """The typed 503 for "P1 is down" (message, ``Retry-After``)."""
        text = message or f"the engine is unavailable ({self.down_reason}); retry the request"
        return EngineUnavailableError(text, retry_after_s=self.retry_after_s)

    async def wait_up(self, timeout: float) -> None:
        """Return once the link is up; :class:`EngineUnavailableError` after ``timeout``."""
        if not self.alive and not self._closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._up.wait(), timeout)
        if self._closed:
            raise EngineUnavailableError("the server is closing")
        if not self.alive:
            raise self.unavailable(
                f"the engine did not come back within {timeout:.0f}s ({self.down_reason}); "
                "retry the request"
            )

    async def start(self, timeout: float = 60.0) -> None:
        """Connect and handshake: returns once P1 answered (our subscription is live)."""
        for sock in (self._push, self._sub):
            sock.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        loop = asyncio.get_running_loop()
        for name, sock in (("input", self._push), ("output", self._sub)):
            monitor = sock.get_monitor_socket(_MONITORED)  # before connect: sees the first
            self._tasks.append(
                loop.create_task(self._monitor(name, monitor), name=f"mmis-engine-{name}-monitor")
            )
        self._push.connect(self.input_address)
        self._sub.connect(self.output_address)
        self._tasks.append(loop.create_task(self._handle_outputs(), name="mmis-engine-outputs"))
        deadline = loop.time() + timeout
        while True:
            try:
                hello = await self.call_utility(HELLO, timeout=0.25)
                break
            except TimeoutError:
                if loop.time() > deadline:
                    raise EngineUnavailableError(
                        f"engine at {self.input_address} did not answer within {timeout:.0f}s"
                    ) from None
        self.cache_epoch = str(hello["cache_epoch"])
        self.last_pong = time.monotonic()
        self._up.set()
        self._tasks.append(loop.create_task(self._watchdog(), name="mmis-engine-watchdog"))

    async def close(self) -> None:
        """Stop the tasks, fail whatever is still in flight, close the sockets (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._up.set()  # wakes every wait_up, which then sees the client closed
        tasks = [*self._tasks, *self._oneshots]
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
        for sock in (self._push, self._sub):
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
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
                self._orphans.update(ids)
                return
            with contextlib.suppress(Exception):
                await self._send(AbortRequests(request_ids=ids, client_index=self.client_index))

    async def call_utility(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        """Call ``method`` in P1; while the link is down only ``hello`` is sent (the others
        fail at once with :class:`EngineUnavailableError`)."""
        if method != HELLO and not self.alive:
            raise self.unavailable()
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            await self._send(UtilityCall(call_id, method, list(args), self.client_index))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)

    # ------------------------------------------------------------------ liveness
    async def _monitor(self, name: str, monitor: zmq.asyncio.Socket) -> None:
        """Track one socket's connection; a disconnect means P1's process is gone."""
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_CONNECTED:
                    self._connected[name] = True
                    self._must_reconnect.discard(name)
                    self._reconnected = not self.alive
                    self._wake.set()
                elif event == zmq.EVENT_DISCONNECTED:
                    self._connected[name] = False
                    if self.alive:  # P1's process is gone: both of its sockets go
                        self._must_reconnect = set(self._connected)
                    self._must_reconnect.add(name)
                    self._lost(f"the engine's {name} socket disconnected: its process is gone")
        finally:
            monitor.close()

    def _silent_for(self) -> float:
        """Seconds a ping has waited with nothing heard from P1 since it was sent; 0 when
        none waits, or when a message from P1 is waiting unread in our socket."""
        if self._asked_at is None:
            return 0.0
        events = self._sub.get(zmq.EVENTS)  # get(), not getsockopt(): pyzmq re-arms its reader
        if isinstance(events, int) and events & zmq.POLLIN:
            return 0.0  # P1 spoke; our own loop has not read it yet
        return time.monotonic() - self._asked_at

    async def _watchdog(self) -> None:
        """Ping P1, take the link down when it falls silent, bring it up when it answers."""
        while True:
            period = self.ping_interval_s
            if not self.alive and self._reconnected and all(self._connected.values()):
                period = min(period, RECONNECT_PING_S)  # a restarted P1 is answering soon
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), period)
            self._wake.clear()
            if self.alive:
                silent = self._silent_for()
                if silent > self.liveness_timeout_s:
                    self._lost(f"the engine sent nothing for {silent:.1f}s: it is hung")
            await self._ping()

    async def _ping(self) -> None:
        """Send one ``hello`` without waiting for its answer, which may bring the link up."""
        call_id = next(self._call_ids)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._calls[call_id] = fut
        fut.add_done_callback(self._on_pong)
        loop.call_later(self.liveness_timeout_s, self._forget_call, call_id)
        if self._asked_at is None:
            self._asked_at = time.monotonic()
        try:  # never waits long: the socket queues without limit (SNDHWM 0)
            await self._send(UtilityCall(call_id, HELLO, [], self.client_index))
        except zmq.ZMQError as exc:
            log.warning("could not ping the engine: %s", exc)
            self._forget_call(call_id)

    def _forget_call(self, call_id: int) -> None:
        fut = self._calls.pop(call_id, None)
        if fut is not None and not fut.done():
            fut.cancel()

    def _on_pong(self, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled() or fut.exception() is not None or self._closed or self.alive:
            return
        if self._must_reconnect:  # a dying P1's last answer, or P1 not reconnected yet
            return
        if self.down_since is not None:
            self._last_outage_s = time.monotonic() - self.down_since
            log.warning(
                "the engine answers again after %.1fs (epoch %s)",
                self._last_outage_s,
                self.cache_epoch,
            )
        self.down_since = None
        self._reconnected = False
        self._up.set()
        if self._orphans:
            ids, self._orphans = sorted(self._orphans), set()
            task = asyncio.get_running_loop().create_task(self.release_orphans(ids))
            self._oneshots.add(task)
            task.add_done_callback(self._oneshots.discard)

    async def release_orphans(self, request_ids: list[str]) -> None:
        """Abort ids a loss failed: P1 may still run them (it only stalled), or receive them
        from our socket's queue (they were on the way when it died)."""
        with contextlib.suppress(Exception):
            await self._send(AbortRequests(request_ids=request_ids, client_index=self.client_index))

    def _lost(self, reason: str) -> None:
        """Take the link down: fail everything in flight now, refuse sends until P1 is back."""
        if not self.alive:
            return  # already down (or never up: the handshake in start() owns that)
        self._up.clear()
        self.down_since = time.monotonic()
        self.down_reason = reason
        self.losses += 1
        log.error("engine lost (%s): failing %d request(s) in flight", reason, len(self._inflight))
        for rid, entry in self._inflight.items():
            entry.queue.put_nowait(error_output(rid, ErrorCode.ENGINE_UNAVAILABLE.value, reason))
        self._orphans.update(self._inflight)
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
        self.last_pong = time.monotonic()
        self._asked_at = None  # P1 spoke: no ping waits any more
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
