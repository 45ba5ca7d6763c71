"""P0's view of P1's liveness: the engine link is *up* or *down*.

:class:`EngineLiveness` is a mixin of :class:`~mmis.frontend.client.engine_client.EngineClient`
(``frontend/client/engine_client.py``), which owns the sockets, the registrations (requests in
flight, pending utility calls) and the output reader; this module owns the link's state (socket
monitors, the ``hello`` watchdog, up/down, :meth:`EngineLiveness.wait_up`, ``Retry-After``)
and decides when the link goes down or up. :attr:`EngineLiveness.alive` is ``/health`` and
half of ``/ready`` (``frontend/state.py``); the recovery rules built on it are in
``frontend/client/recovery.py``.

Invariants:
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
  attempt can follow), fails every pending utility call (both done by the client's
  ``_fail_in_flight``, the owner of the registrations), and refuses new sends
  (:class:`EngineUnavailableError`) until the link is up again; the ids are remembered.
- A dead P1 drops both sockets: after a disconnect, only an answer read once *both* sockets
  reconnected brings the link up (a dying P1 may still answer a ``hello`` on its way out, and
  the two monitors are read independently), so one death is one loss and one heal.
- **Coming back** needs a ``hello`` answered after the sockets reconnected (a restarted P1)
  or after the silence ended (a stopped P1 continued). Its batch runs the epoch-change path
  first (a restarted P1 has a new cache epoch: the shadow is dropped before any new render),
  then the link is up, waiters of :meth:`EngineLiveness.wait_up` resume, and one abort of the
  remembered ids goes out (a P1 that was only stalled, or a request queued in the socket when
  P1 died, must not run for nobody).
- Everything here runs on the event loop's thread; nothing blocks it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Iterable
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from mmis.frontend.errors import EngineUnavailableError
from mmis.protocol.messages import AbortRequests, EngineCoreRequest, UtilityCall

log = logging.getLogger(__name__)

HELLO = "hello"
RECONNECT_PING_S = 0.1  # ping period while the sockets are connected but P1 has not answered
MAX_RETRY_AFTER_S = 30.0
_MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


class EngineLiveness:
    """The liveness half of :class:`~mmis.frontend.client.engine_client.EngineClient`.

    The host sets the attributes declared below and implements the four methods that raise
    :class:`NotImplementedError`; it calls :meth:`_init_liveness` in its constructor,
    :meth:`_watch_sockets` before connecting, :meth:`_handshaken` once P1 answered the first
    ``hello``, :meth:`_heard_from_engine` for every batch read, :meth:`_abort_when_up` for ids
    it cannot abort while the link is down, and :meth:`_stop_liveness` and
    :meth:`_unwatch_sockets` when it closes."""

    # set by the host (EngineClient)
    client_index: int
    cache_epoch: str
    _closed: bool
    _push: zmq.asyncio.Socket
    _sub: zmq.asyncio.Socket
    _tasks: list[asyncio.Task[None]]

    def _init_liveness(self, ping_interval_s: float, liveness_timeout_s: float) -> None:
        self.ping_interval_s = ping_interval_s
        self.liveness_timeout_s = liveness_timeout_s
        self.last_pong = 0.0  # monotonic time of P1's latest batch
        self._asked_at: float | None = None  # the first ping sent after P1's latest batch
        self.losses = 0  # times the link went down after being up
        self.down_since: float | None = None  # monotonic; None while up (or never up yet)
        self.down_reason = "the engine has not answered yet"
        self._last_outage_s = 0.0
        self._connected = {"input": False, "output": False}
        # sockets that must reconnect before an answer may bring the link up (P1 died)
        self._must_reconnect: set[str] = set()
        self._up = asyncio.Event()
        self._wake = asyncio.Event()  # a socket connected: ping now
        self._reconnected = False  # a socket connected again while the link was down
        self._oneshots: set[asyncio.Task[None]] = set()
        self._orphans: set[str] = set()  # ids failed by a loss; aborted once P1 answers again

    # ------------------------------------------------------------------ the host's part
    async def _send(self, msg: EngineCoreRequest | AbortRequests | UtilityCall) -> None:
        raise NotImplementedError

    def _new_call(self) -> tuple[int, asyncio.Future[Any]]:
        """Register a pending utility call: its id and the future its answer resolves."""
        raise NotImplementedError

    def _forget_call(self, call_id: int) -> None:
        """Drop a pending utility call, cancelling its future if still pending."""
        raise NotImplementedError

    def _fail_in_flight(self, reason: str) -> None:
        """The link went down: fail every registration (see the module's invariants)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the link's state
    @property
    def alive(self) -> bool:
        """Whether the link is up: P1 handshaked, its sockets are connected and it answered
        within ``liveness_timeout_s`` (the watchdog keeps this current)."""
        return not self._closed and self._up.is_set()

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

    # ------------------------------------------------------------------ life cycle
    def _watch_sockets(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start one monitor per socket (before connect: it sees the first connection)."""
        for name, sock in (("input", self._push), ("output", self._sub)):
            monitor = sock.get_monitor_socket(_MONITORED)
            self._tasks.append(
                loop.create_task(self._monitor(name, monitor), name=f"mmis-engine-{name}-monitor")
            )

    def _handshaken(self, loop: asyncio.AbstractEventLoop) -> None:
        """P1 answered the handshake: the link is up, the watchdog starts."""
        self.last_pong = time.monotonic()
        self._up.set()
        self._tasks.append(loop.create_task(self._watchdog(), name="mmis-engine-watchdog"))

    def _heard_from_engine(self) -> None:
        """A batch from P1 was read: P1 spoke, no ping waits any more."""
        self.last_pong = time.monotonic()
        self._asked_at = None

    def _abort_when_up(self, request_ids: Iterable[str]) -> None:
        """Remember ids to abort once P1 answers again (nothing reaches it while down)."""
        self._orphans.update(request_ids)

    def _stop_liveness(self) -> list[asyncio.Task[None]]:
        """The client is closing: wake every :meth:`wait_up` (which then sees the client
        closed); returns the one-shot tasks for the host to cancel with its own."""
        self._up.set()
        return list(self._oneshots)

    def _unwatch_sockets(self) -> None:
        for sock in (self._push, self._sub):
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()

    # ------------------------------------------------------------------ detection
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
        call_id, fut = self._new_call()
        fut.add_done_callback(self._on_pong)
        asyncio.get_running_loop().call_later(self.liveness_timeout_s, self._forget_call, call_id)
        if self._asked_at is None:
            self._asked_at = time.monotonic()
        try:  # never waits long: the socket queues without limit (SNDHWM 0)
            await self._send(UtilityCall(call_id, HELLO, [], self.client_index))
        except zmq.ZMQError as exc:
            log.warning("could not ping the engine: %s", exc)
            self._forget_call(call_id)

    # ------------------------------------------------------------------ up and down
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
        self._fail_in_flight(reason)
