"""P1's output side: batches for each client (P0) on one PUB socket.

Invariants:
- Only the thread running :meth:`OutputChannel.run` touches the PUB socket; every other
  thread just enqueues (:meth:`send`, :meth:`answer`), so the order of batches for a client
  is the order they were enqueued.
- Each batch goes out under its client's topic ``b"c<client_index>"`` and carries the engine
  index, a timestamp and the cache epoch current when it was enqueued.
- **What each client has not heard of the receiver cache** (the N-shadow invariant is in
  ``multimodal/cache.py``) is kept per known client as one record per hash, the last event
  winning: evicted, or stored by *another* client's request (:meth:`publish`). It goes out,
  all of it and once, with that client's next batch, whatever the batch is (an output, or
  the answer to its ``hello`` heartbeat, so an idle P0 learns it within one ping interval):
  ``shadow_reset`` first, then ``evicted_mm_hashes``, then ``stored_mm_items``.
- **Bounded.** A client becomes known with its utility calls (``hello`` every
  ``--ping-interval-s``); one silent for :data:`CLIENT_TTL_S` is forgotten. A backlog holds
  at most :data:`MAX_BACKLOG` hashes: past that it is dropped and replaced by one
  ``shadow_reset`` flag (forget the whole shadow; safe, since a shadow that believes less
  only resends data). A client seen for the first time (new, or forgotten) also gets a
  reset. So P1 keeps at most ``MAX_BACKLOG`` records per live client, whatever a slow or
  gone client does. While no client is known, evictions are kept for client 0.
- :meth:`close` stops the thread after the batches enqueued before it went out.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Final

import zmq

from mmis.protocol.codec import WireCodec
from mmis.protocol.messages import CachedItem, EngineCoreOutput, EngineCoreOutputs, UtilityResult

MAX_BACKLOG: Final = 4096
"""Unheard receiver-cache records kept per client (one per hash) before a reset replaces them."""

CLIENT_TTL_S: Final = 60.0
"""A client that made no utility call (its heartbeat) for this long is forgotten."""


def topic(client_index: int) -> bytes:
    return b"c%d" % client_index


@dataclasses.dataclass
class _Backlog:
    """What one client has not heard yet. ``None`` records an eviction."""

    heard: float
    reset: bool = False
    records: OrderedDict[str, CachedItem | None] = dataclasses.field(default_factory=OrderedDict)

    def add(self, mm_hash: str, record: CachedItem | None) -> None:
        if self.reset:
            return  # the client forgets everything anyway: nothing to add
        self.records.pop(mm_hash, None)
        self.records[mm_hash] = record
        if len(self.records) > MAX_BACKLOG:
            self.records.clear()
            self.reset = True


class OutputChannel:
    def __init__(
        self,
        *,
        cache_epoch: str,
        engine_index: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache_epoch = cache_epoch
        self.engine_index = engine_index
        self._clock = clock
        self._queue: queue.Queue[tuple[int, EngineCoreOutputs] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._backlogs: dict[int, _Backlog] = {}
        self.resets = 0  # backlogs replaced by a reset (overflow, new or forgotten client)

    def register(self, client: int) -> None:
        """``client`` was heard from (a utility call): known from now on; a client seen for
        the first time, or again after being forgotten, is told to reset its shadow. Clients
        silent for :data:`CLIENT_TTL_S` are forgotten here."""
        now = self._clock()
        with self._lock:
            for other in [c for c, b in self._backlogs.items() if now - b.heard > CLIENT_TTL_S]:
                if other != client:
                    del self._backlogs[other]
            backlog = self._backlogs.get(client)
            if backlog is None or now - backlog.heard > CLIENT_TTL_S:
                self._backlogs[client] = _Backlog(heard=now, reset=True)
                self.resets += 1
            else:
                backlog.heard = now

    def resync(self, client: int, snapshot: Sequence[CachedItem]) -> None:
        """Replace ``client``'s backlog by a reset and ``snapshot`` (what the receiver holds
        now, oldest first): a fresh shadow then believes exactly that."""
        with self._lock:
            backlog = _Backlog(heard=self._clock())
            for item in snapshot[-MAX_BACKLOG:]:
                backlog.add(item.mm_hash, item)
            backlog.reset = True
            self._backlogs[client] = backlog

    def publish(
        self, stored: Iterable[CachedItem], evicted: Iterable[str], origin: int | None = None
    ) -> None:
        """Queue what the receiver cache did for every known client: ``evicted`` for all,
        ``stored`` for all but ``origin`` (the client whose request stored it: its shadow
        recorded it already)."""
        stored, evicted = list(stored), list(evicted)
        if not stored and not evicted:
            return
        with self._lock:
            if not self._backlogs and evicted:
                self._backlogs[0] = _Backlog(heard=self._clock())
            for client, backlog in self._backlogs.items():
                for mm_hash in evicted:
                    backlog.add(mm_hash, None)
                if client != origin:
                    for item in stored:
                        backlog.add(item.mm_hash, item)

    def forget_all(self) -> None:
        """Drop every backlog's records (the receiver was emptied under a new epoch, which
        clears every shadow by itself)."""
        with self._lock:
            for backlog in self._backlogs.values():
                backlog.records.clear()

    def backlog_size(self, client: int) -> int:
        """Records kept for ``client`` (0 for an unknown client)."""
        with self._lock:
            backlog = self._backlogs.get(client)
            return 0 if backlog is None else len(backlog.records)

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

    def attach_backlog(self, client: int, batch: EngineCoreOutputs) -> None:
        """Move everything ``client`` has not heard onto ``batch`` (the output thread)."""
        with self._lock:
            backlog = self._backlogs.get(client)
            if backlog is None or not (backlog.reset or backlog.records):
                return
            records, backlog.records = backlog.records, OrderedDict()
            reset, backlog.reset = backlog.reset, False
        batch.shadow_reset = reset
        batch.evicted_mm_hashes = [h for h, item in records.items() if item is None]
        batch.stored_mm_items = [item for item in records.values() if item is not None]

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
                self.attach_backlog(client, batch)
                sock.send_multipart([topic(client), *codec.encode_outputs(batch)], copy=False)
        finally:
            sock.close()
