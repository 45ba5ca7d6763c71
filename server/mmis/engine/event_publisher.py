"""One stream of cache events over ZMQ, framed as vLLM frames its KV events (docs/ROUTING.md).

- Live: a PUB socket sends ``(topic, seq, payload)``. ``seq`` is 8 bytes big-endian and
  counts from 0 per publisher, so a subscriber sees a gap as a jump. ``payload`` is one
  msgpack batch (``protocol/kv_events.py``).
- Replay: a ROUTER socket answers a DEALER's ``(b"", start_seq)`` with every buffered
  ``(b"", topic, seq, payload)`` whose ``seq >= start_seq`` (buffered when the request is
  taken up), then the end marker ``(b"", b"", 0xff * 8, b"")``.
- Who may connect: with a token both sockets are ZMQ PLAIN servers and only user ``mmis``
  with the token as password gets in; without one they bind loopback only
  (``engine/event_auth.py``, docs/SECURITY.md).

Bounds (issue 41: a slow or hostile peer costs bounded memory):
- The replay buffer keeps the last ``buffer_batches`` batches (:data:`BUFFER_BATCHES`) and at
  most ``buffer_bytes`` of payload (:data:`BUFFER_BYTES`), whichever is smaller; a single
  batch larger than that is kept alone until the next one.
- Live: a subscriber that does not read holds at most ``hwm`` (:data:`LIVE_HWM`) batches in
  this process; beyond that the PUB drops its batches, for it alone and silently (libzmq's
  PUB reports nothing), and the subscriber sees a gap, which it fills from the replay.
- Replays: at most :data:`MAX_REPLAYS` run at once; up to :data:`MAX_QUEUED_REPLAYS` more wait
  (a request beyond that, or a second one from a peer already served, is dropped: the
  requester times out and asks again). A replay keeps a cursor into the buffer, holds no copy
  of it, and sends only while its peer reads: at most :data:`REPLAY_PEER_HWM` batches wait in
  this process for one replay peer (``ROUTER_MANDATORY`` and non-blocking sends; a full peer
  is retried after a back-off of 1 to 50 ms). A replay that made no progress for
  :data:`REPLAY_STALL_S` s, whose peer left, or whose next batch left the buffer is abandoned
  without its end marker (the requester times out).
- Inbound: a message (a subscription, a replay request, a handshake command) larger than
  :data:`MAX_INBOUND_BYTES` closes its connection (``ZMQ_MAXMSGSIZE``); a peer queues at most
  :data:`INBOUND_HWM` messages; a handshake not done in :data:`HANDSHAKE_MS` ms is dropped.
- The kernel holds at most :data:`SOCKET_SNDBUF` (doubled by Linux) unsent bytes per
  connection (``SO_SNDBUF``): memory a pod's cgroup is charged for too.
- So beyond the buffer, one publisher holds at most ``(subscribers * LIVE_HWM + replay peers
  * REPLAY_PEER_HWM)`` queued batches, each a payload plus about 64 bytes per frame of
  libzmq's message headers, and libzmq's per-connection buffers (two 8 KiB batch buffers).
  ``tests/security/test_event_publisher_bounds.py`` measures it with 400 replay peers.

Invariants:
- :meth:`EventPublisher.publish` never blocks the engine: the PUB sends without blocking and
  drops at a subscriber's high-water mark; the batch stays in the replay buffer
  (:attr:`EventPublisher.dropped` counts a send the socket refused outright).
- Only the caller's thread touches the PUB socket, and only the replay thread touches the
  ROUTER (the ZAP handler's thread its own socket). The buffer between them is guarded by a
  lock, held only to append or to copy a few references.
- :meth:`close` stops the replay thread and closes both sockets. Closing twice is harmless.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq

from mmis.engine.event_auth import EventSocketError, ZapHandler, is_loopback, secure_server
from mmis.protocol.kv_events import EventBatch

END_SEQ = b"\xff" * 8
BUFFER_BATCHES = 10_000
BUFFER_BYTES = 64 << 20  # 64 MiB of payload in the replay buffer at most
LIVE_HWM = 256  # batches queued per live subscriber (about 1-3 s of steps with events)
REPLAY_PEER_HWM = 32  # batches queued per replay peer
MAX_REPLAYS = 4  # replays sending at once
MAX_QUEUED_REPLAYS = 16  # replay requests waiting for a turn
REPLAY_STALL_S = 3.0  # a replay without progress for this long is abandoned
# a handshake command is the largest thing a peer should send: PLAIN's HELLO carries a user
# and a password of at most 255 bytes each, INITIATE an identity of at most 255
MAX_INBOUND_BYTES = 1024
INBOUND_HWM = 16  # messages queued per peer before the connection is read no more
# the kernel's send buffer per connection (Linux doubles it; a pod's cgroup is charged for it):
# room for a replay over a fast network, without letting the kernel hold megabytes per peer
SOCKET_SNDBUF = 128 << 10
HANDSHAKE_MS = 5000
_POLL_MS = 100
_CHUNK = REPLAY_PEER_HWM  # batches one look into the buffer copies
_MIN_WAIT_S, _MAX_WAIT_S = 0.001, 0.05  # a full replay peer is retried after this back-off
_REQUESTS_PER_TURN = 64  # replay requests read before the running replays go on


@dataclasses.dataclass
class _Replay:
    peer: bytes
    cursor: int  # the next seq to send
    end: int  # the first seq not to send: the buffer's next seq when the replay began
    progress_at: float  # monotonic time of the last batch the peer took
    wait_s: float = 0.0  # the current back-off after a full pipe
    retry_at: float = 0.0


class EventPublisher:
    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        token: str | bytes | None = None,
        buffer_batches: int = BUFFER_BATCHES,
        buffer_bytes: int = BUFFER_BYTES,
        hwm: int = LIVE_HWM,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Bind the PUB on ``endpoint`` and, if given, the replay ROUTER on
        ``replay_endpoint``. ``token``: the PLAIN password every peer must present; without
        one an endpoint that is not loopback raises :class:`EventSocketError`."""
        secret = token.encode() if isinstance(token, str) else token
        if secret is None:
            for ep in (endpoint, replay_endpoint):
                if ep is not None and not is_loopback(ep):
                    raise EventSocketError(
                        f"{ep} is not a loopback address: an event socket reachable from other "
                        "hosts needs the events token (docs/SECURITY.md)"
                    )
        self._topic = topic.encode()
        self._clock = clock
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque()
        self._max_batches = buffer_batches
        self._max_bytes = buffer_bytes
        self._bytes = 0
        self._lock = threading.Lock()
        self._seq = 0
        self.dropped = 0  # live sends refused outright (a high-water mark drops silently)
        self.replays_refused = 0  # replay requests dropped (queue full, or a duplicate)
        self.replays_abandoned = 0  # replays given up (stalled, peer gone, fell off the buffer)
        self.replays_done = 0
        self._zap = ZapHandler.acquire(ctx, secret) if secret is not None else None
        self._pub = ctx.socket(zmq.PUB)
        self.replay_endpoint: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self._setup(self._pub, secret)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if replay_endpoint is not None:
                router = ctx.socket(zmq.ROUTER)
                try:
                    self._setup(router, secret)
                    router.setsockopt(zmq.SNDHWM, REPLAY_PEER_HWM)
                    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                    router.bind(replay_endpoint)
                except BaseException:
                    router.close(linger=0)
                    raise
                self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
                self._thread = threading.Thread(
                    target=self._serve_replays,
                    args=(router,),
                    name="mmis-event-replay",
                    daemon=True,
                )
                self._thread.start()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _setup(sock: zmq.Socket[bytes], secret: bytes | None) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND_BYTES)
        sock.setsockopt(zmq.RCVHWM, INBOUND_HWM)
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        sock.setsockopt(zmq.SNDBUF, SOCKET_SNDBUF)
        secure_server(sock, secret)

    @property
    def buffered(self) -> tuple[int, int]:
        """``(batches, payload bytes)`` the replay buffer holds now."""
        with self._lock:
            return len(self._buffer), self._bytes

    def publish(self, events: Sequence[msgspec.Struct]) -> int:
        """Send one batch of ``events`` stamped now; returns its sequence number."""
        payload = self._encoder.encode(EventBatch(ts=self._clock(), events=list(events)))
        with self._lock:
            seq = self._seq
            self._seq += 1
            buffer = self._buffer
            buffer.append((seq, payload))
            self._bytes += len(payload)
            while len(buffer) > 1 and (
                len(buffer) > self._max_batches or self._bytes > self._max_bytes
            ):
                self._bytes -= len(buffer.popleft()[1])
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
        return seq

    # -- the replay thread ---------------------------------------------------------------

    def _serve_replays(self, router: zmq.Socket[bytes]) -> None:
        running: dict[bytes, _Replay] = {}
        waiting: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        try:
            while not self._stop.is_set():
                timeout = _POLL_MS
                if running:
                    soonest = min(r.retry_at for r in running.values())
                    timeout = max(0, min(_POLL_MS, int((soonest - time.monotonic()) * 1000) + 1))
                if router.poll(timeout):
                    self._take_requests(router, running, waiting)
                while waiting and len(running) < MAX_REPLAYS:
                    peer, start = waiting.popitem(last=False)
                    running[peer] = self._begin(peer, start)
                now = time.monotonic()
                for peer, replay in list(running.items()):
                    if replay.retry_at <= now and self._advance(router, replay):
                        del running[peer]
        finally:
            router.close(linger=0)

    def _take_requests(
        self,
        router: zmq.Socket[bytes],
        running: dict[bytes, _Replay],
        waiting: collections.OrderedDict[bytes, int],
    ) -> None:
        for _ in range(_REQUESTS_PER_TURN):
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
                continue  # not a replay request: ignored, the requester times out
            peer = frames[0]
            if peer in running or peer in waiting or len(waiting) >= MAX_QUEUED_REPLAYS:
                self.replays_refused += 1
                continue
            waiting[peer] = int.from_bytes(frames[2], "big")

    def _begin(self, peer: bytes, start: int) -> _Replay:
        with self._lock:
            first = self._buffer[0][0] if self._buffer else self._seq
            end = self._seq
        return _Replay(peer, max(start, first), end, time.monotonic())

    def _advance(self, router: zmq.Socket[bytes], replay: _Replay) -> bool:
        """Send what ``replay``'s peer takes now; True when the replay is over (done or
        abandoned)."""
        progressed = False
        while True:
            if replay.cursor >= replay.end:
                frames: Sequence[Sequence[bytes]] = [(replay.peer, b"", b"", END_SEQ, b"")]
            else:
                with self._lock:
                    buffer = self._buffer
                    first = buffer[0][0] if buffer else self._seq
                    if replay.cursor < first:
                        frames = []  # its next batch left the buffer: the peer is too slow
                    else:
                        at = replay.cursor - first
                        stop = min(len(buffer), at + _CHUNK, at + replay.end - replay.cursor)
                        frames = [
                            (replay.peer, b"", self._topic, seq.to_bytes(8, "big"), payload)
                            for seq, payload in (buffer[i] for i in range(at, stop))
                        ]
                if not frames:
                    self.replays_abandoned += 1
                    return True
            for message in frames:
                try:
                    router.send_multipart(message, zmq.NOBLOCK)
                except zmq.Again:  # the peer's pipe is full: it is not reading
                    now = time.monotonic()
                    if not progressed and now - replay.progress_at > REPLAY_STALL_S:
                        self.replays_abandoned += 1
                        return True
                    wait = _MIN_WAIT_S if progressed else min(_MAX_WAIT_S, 2 * replay.wait_s)
                    replay.wait_s = max(_MIN_WAIT_S, wait)
                    replay.retry_at = now + replay.wait_s
                    return False
                except zmq.ZMQError:  # EHOSTUNREACH: the peer left
                    self.replays_abandoned += 1
                    return True
                if message[3] == END_SEQ:
                    self.replays_done += 1
                    return True
                replay.cursor += 1
                replay.progress_at = time.monotonic()
                progressed = True

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5 * _POLL_MS / 1000)
            self._thread = None
        self._pub.close(linger=0)
        if self._zap is not None:
            self._zap.release()
            self._zap = None


class EventStream:
    """A log of pending events (anything with ``drain() -> list``) and the publisher its
    batches go out on. The stream opens with ``opening`` (what a new engine life says first:
    ``AllBlocksCleared``, ``EpochStarted``); :meth:`flush` sends what the log gathered."""

    def __init__(self, log: Any, publisher: EventPublisher, opening: Sequence[Any]) -> None:
        self.log = log
        self.publisher = publisher
        publisher.publish(opening)

    def flush(self) -> None:
        events = self.log.drain()
        if events:
            self.publisher.publish(events)

    def close(self) -> None:
        self.publisher.close()
