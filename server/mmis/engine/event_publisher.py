"""One stream of cache events over ZMQ, framed as vLLM frames its KV events (docs/ROUTING.md).

- Live: a PUB socket sends ``(topic, seq, payload)``. ``seq`` is 8 bytes big-endian and
  counts from 0 per publisher, so a subscriber sees a gap as a jump. ``payload`` is one
  msgpack batch (``protocol/kv_events.py``).
- Replay: a ROUTER socket answers a DEALER's ``(b"", start_seq)`` with every buffered
  ``(b"", topic, seq, payload)`` whose ``seq >= start_seq``, then the end marker
  ``(b"", b"", 0xff * 8, b"")``. The buffer keeps the last ``buffer_batches`` batches.

Invariants:
- :meth:`EventPublisher.publish` never blocks the engine. A PUB socket at its high-water
  mark drops the message; the batch stays in the replay buffer and
  :attr:`EventPublisher.dropped` counts it.
- Only the caller's thread touches the PUB socket, and only the replay thread touches the
  ROUTER. The buffer between them is guarded by a lock.
- :meth:`close` stops the replay thread and closes both sockets. Closing twice is harmless.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq

from mmis.protocol.kv_events import EventBatch

END_SEQ = b"\xff" * 8
_POLL_MS = 100


class EventPublisher:
    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_batches: int = 10_000,
        hwm: int = 100_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._topic = topic.encode()
        self._clock = clock
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=buffer_batches
        )
        self._lock = threading.Lock()
        self._seq = 0
        self.dropped = 0
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay_endpoint is not None:
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(replay_endpoint)
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(
                target=self._serve_replays, args=(router,), name="mmis-event-replay", daemon=True
            )
            self._thread.start()

    def publish(self, events: Sequence[msgspec.Struct]) -> int:
        """Send one batch of ``events`` stamped now; returns its sequence number."""
        payload = self._encoder.encode(EventBatch(ts=self._clock(), events=list(events)))
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
        return seq

    def _serve_replays(self, router: zmq.Socket[bytes]) -> None:
        try:
            while not self._stop.is_set():
                if not router.poll(_POLL_MS):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    continue  # not a replay request: ignored, the requester times out
                client, start = frames[0], int.from_bytes(frames[2], "big")
                with self._lock:
                    wanted = [(seq, payload) for seq, payload in self._buffer if seq >= start]
                for seq, payload in wanted:
                    router.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
                router.send_multipart((client, b"", b"", END_SEQ, b""))
        finally:
            router.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5 * _POLL_MS / 1000)
            self._thread = None
        self._pub.close(linger=0)


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
