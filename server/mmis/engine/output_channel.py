"""P1's output side: batches for each client (P0) on one PUB socket.

Invariants:
- Only the thread running :meth:`OutputChannel.run` touches the PUB socket; every other
  thread just enqueues (:meth:`send`, :meth:`answer`), so the order of batches for a client
  is the order they were enqueued.
- Each batch goes out under its client's topic ``b"c<client_index>"`` and carries the engine
  index, a timestamp and the cache epoch current when it was enqueued.
- Evictions are kept per known client (a client becomes known with its first utility call,
  the ``hello`` handshake) and each is delivered once, with that client's next batch; while
  no client is known they are kept for client 0.
- :meth:`close` stops the thread after the batches enqueued before it went out.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable

import zmq

from mmis.protocol.codec import WireCodec
from mmis.protocol.messages import EngineCoreOutput, EngineCoreOutputs, UtilityResult


def topic(client_index: int) -> bytes:
    return b"c%d" % client_index


class OutputChannel:
    def __init__(self, *, cache_epoch: str, engine_index: int = 0) -> None:
        self.cache_epoch = cache_epoch
        self.engine_index = engine_index
        self._queue: queue.Queue[tuple[int, EngineCoreOutputs] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._evicted: dict[int, list[str]] = {}

    def register(self, client: int) -> None:
        """Make ``client`` known: evictions from now on are queued for it too."""
        with self._lock:
            self._evicted.setdefault(client, [])

    def publish_evictions(self, hashes: Iterable[str]) -> None:
        hashes = list(hashes)
        if not hashes:
            return
        with self._lock:
            for client in list(self._evicted) or [0]:
                self._evicted.setdefault(client, []).extend(hashes)

    def send(self, client: int, outputs: list[EngineCoreOutput]) -> None:
        self._queue.put((client, self._batch(outputs)))

    def answer(self, client: int, result: UtilityResult) -> None:
        self._queue.put((client, self._batch([], utility=result)))

    def close(self) -> None:
        self._queue.put(None)

    def _batch(
        self, outputs: list[EngineCoreOutput], utility: UtilityResult | None = None
    ) -> EngineCoreOutputs:
        return EngineCoreOutputs(
            outputs=outputs,
            engine_index=self.engine_index,
            timestamp=time.time(),
            cache_epoch=self.cache_epoch,
            utility_result=utility,
        )

    def run(self, ctx: zmq.Context[zmq.Socket[bytes]], address: str) -> None:
        """Bind the PUB socket at ``address`` and send batches until :meth:`close`."""
        sock = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.bind(address)
        codec = WireCodec()
        try:
            while (item := self._queue.get()) is not None:
                client, batch = item
                with self._lock:
                    evicted = self._evicted.get(client)
                    if evicted:
                        batch.evicted_mm_hashes = list(evicted)
                        evicted.clear()
                sock.send_multipart([topic(client), *codec.encode_outputs(batch)], copy=False)
        finally:
            sock.close()
