"""P1's multimodal receiver cache: a byte-budget LRU of real tensors, keyed by mm_hash.

Invariants:
- Same policy as P0's shadow: the shared :class:`ByteBudgetLRU` and the shared
  :func:`item_nbytes`, so both sides charge, order and evict identically while they agree.
- :meth:`ReceiverCache.resolve` handles a request in three steps: (1) touch every feature's
  key that is stored and capture the tensors of the ``data=None`` features right then,
  (2) store every feature that carries data (a dict of tensors, or an ``ShmAddress`` read
  through the injected ``shm_reader``), in request order, a resent payload replacing a stale
  entry, (3) if any ``data=None`` feature was neither stored at (1) nor carried by a sibling,
  raise ONE :class:`MultiModalCacheMissError` naming every missing hash. The good items are
  ingested before the error is raised, so the retry only needs to carry the missing ones.
- Items larger than the whole budget are used for their request but never stored.
- Evictions made by storing are kept until :meth:`drain_evicted`, which reports only hashes
  that are still absent (one evicted then resent in between is not stale news).
- The fault hooks :meth:`evict` and :meth:`evict_random` drop entries silently by default,
  to create drift on purpose (operator-only fault knob, scenario S1d).
- Single-threaded by design: only P1's input thread calls into it, so there is no lock.
"""

from __future__ import annotations

import dataclasses
import random
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from mmis.multimodal.lru import ByteBudgetLRU
from mmis.multimodal.sizing import item_nbytes
from mmis.protocol.errors import MultiModalCacheMissError, ProtocolError
from mmis.protocol.messages import MultiModalFeature, ShmAddress

Tensors = dict[str, Any]
ShmReader = Callable[[ShmAddress], dict[str, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class ReceiverCacheStats:
    hits: int
    misses: int
    stored: int
    oversize: int
    evictions: int
    fault_evictions: int
    entries: int
    total_bytes: int
    capacity_bytes: int


def _key(feature: MultiModalFeature) -> str:
    return feature.mm_hash or feature.identifier


class ReceiverCache:
    """The tensors P0's shadow believes P1 holds. Only P1's input thread touches it."""

    def __init__(self, capacity_bytes: int, shm_reader: ShmReader | None = None) -> None:
        self._lru: ByteBudgetLRU[str, Tensors] = ByteBudgetLRU(capacity_bytes)
        self._shm_reader = shm_reader
        self._evicted: list[str] = []
        self.epoch = uuid.uuid4().hex  # changes on every P1 start
        self.hits = 0
        self.misses = 0
        self.stored = 0
        self.oversize = 0
        self.evictions = 0
        self.fault_evictions = 0

    @property
    def capacity_bytes(self) -> int:
        return self._lru.capacity_bytes

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self._lru

    def keys(self) -> list[str]:
        """Stored hashes, least recently used first."""
        return list(self._lru)

    def peek(self, mm_hash: str) -> Tensors | None:
        """The stored tensors for ``mm_hash``, without changing the order."""
        return self._lru.peek(mm_hash)

    def resolve(self, features: Sequence[MultiModalFeature]) -> list[Tensors]:
        """The tensors of every feature, in order; raises one error for all missing ones."""
        resolved: list[Tensors | None] = [None] * len(features)
        for i, feature in enumerate(features):
            key = _key(feature)
            if not self._lru.touch(key):
                continue
            if feature.data is None:
                resolved[i] = self._lru.peek(key)
        provided: dict[str, Tensors] = {}
        for i, feature in enumerate(features):
            if feature.data is None:
                continue
            tensors = self._read(feature)
            self._store(_key(feature), tensors)
            provided[_key(feature)] = tensors
            resolved[i] = tensors
        missing: list[str] = []
        for i, feature in enumerate(features):
            if feature.data is not None:
                continue
            if resolved[i] is None:
                resolved[i] = provided.get(_key(feature))
            if resolved[i] is None:
                missing.append(_key(feature))
                self.misses += 1
            else:
                self.hits += 1
        if missing:
            raise MultiModalCacheMissError(missing)
        return [tensors for tensors in resolved if tensors is not None]

    def _read(self, feature: MultiModalFeature) -> Tensors:
        data = feature.data
        if isinstance(data, ShmAddress):
            if self._shm_reader is None:
                raise ProtocolError(
                    f"item {_key(feature)!r} arrived as a shared-memory address, but this "
                    "engine has no shared-memory reader (cache type is not 'shm')"
                )
            return self._shm_reader(data)
        if not isinstance(data, Mapping):
            raise ProtocolError(
                f"item {_key(feature)!r} carries data of type {type(data).__name__}; "
                "expected a mapping of tensor name to array, an address or None"
            )
        return dict(data)

    def _store(self, mm_hash: str, tensors: Tensors) -> None:
        nbytes = item_nbytes(tensors)
        if self._lru.fits(nbytes):
            self.stored += 1
        else:
            self.oversize += 1  # used for this request only; put() drops any stale entry
        self._note_evicted(self._lru.put(mm_hash, tensors, nbytes))

    def _note_evicted(self, hashes: list[str]) -> None:
        self.evictions += len(hashes)
        self._evicted.extend(hashes)

    def drain_evicted(self) -> list[str]:
        """Hashes evicted since the last drain that are still absent, oldest first."""
        evicted, self._evicted = self._evicted, []
        return [h for h in dict.fromkeys(evicted) if h not in self._lru]

    def evict(self, mm_hashes: Iterable[str], *, silent: bool = True) -> list[str]:
        """Drop ``mm_hashes`` on purpose; return those that were stored.

        Silent by default (the point of the fault knob is drift P0 does not know about);
        ``silent=False`` also queues them for :meth:`drain_evicted`.
        """
        dropped = [h for h in dict.fromkeys(mm_hashes) if self._lru.pop(h) is not None]
        self.fault_evictions += len(dropped)
        if not silent:
            self._evicted.extend(dropped)
        return dropped

    def evict_random(self, rate: float, rng: random.Random, *, silent: bool = True) -> list[str]:
        """Drop each stored entry with probability ``rate`` (0..1); return the dropped."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"eviction rate must be within [0, 1], got {rate}")
        victims = [h for h in self._lru if rng.random() < rate]
        return self.evict(victims, silent=silent)

    def clear(self) -> None:
        """Drop everything without reporting (a restart gets a new epoch instead)."""
        self._lru.clear()
        self.epoch = uuid.uuid4().hex

    def stats(self) -> ReceiverCacheStats:
        return ReceiverCacheStats(
            hits=self.hits,
            misses=self.misses,
            stored=self.stored,
            oversize=self.oversize,
            evictions=self.evictions,
            fault_evictions=self.fault_evictions,
            entries=len(self._lru),
            total_bytes=self._lru.total_bytes,
            capacity_bytes=self._lru.capacity_bytes,
        )
