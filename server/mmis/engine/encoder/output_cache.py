"""The encoder's output cache: a byte-budgeted LRU keyed by ``(EncoderKey, mm_hash)``.

Invariants:
- ``bytes <= capacity`` at all times: storing evicts least recently used entries (oldest
  first) until the new one fits; an entry larger than the whole budget is not stored (the
  caller still answers with it) and evicts nothing.
- A hit (:meth:`get`) makes the entry the most recently used.
- Every store and eviction is told to the listener (an :class:`~mmis.engine.mm_events.MMEventLog`
  or anything with ``stored(mm_hash, nbytes)`` / ``evicted([mm_hash, ...])``), in that order
  for one :meth:`put`: the evictions it caused, then the store. Replacing an entry under the
  same key is a store of the new size (no eviction event).
- Torch-free: values are opaque, their size is the caller's ``nbytes``. One thread uses it
  (the encoder's loop); counters may be read from others.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any, Protocol

from mmis.protocol.encoder import EncoderKey


class CacheListener(Protocol):
    def stored(self, mm_hash: str, nbytes: int) -> None: ...

    def evicted(self, mm_hashes: Sequence[str]) -> None: ...


class OutputCache:
    def __init__(self, capacity_bytes: int, listener: CacheListener | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity = int(capacity_bytes)
        self.listener = listener
        self._entries: collections.OrderedDict[tuple[EncoderKey, str], tuple[Any, int]] = (
            collections.OrderedDict()
        )
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.stores = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry: tuple[EncoderKey, str]) -> bool:
        return entry in self._entries

    def get(self, key: EncoderKey, mm_hash: str) -> Any | None:
        """The stored value (now the most recently used), or None (a miss)."""
        found = self._entries.get((key, mm_hash))
        if found is None:
            self.misses += 1
            return None
        self._entries.move_to_end((key, mm_hash))
        self.hits += 1
        return found[0]

    def put(self, key: EncoderKey, mm_hash: str, value: Any, nbytes: int) -> bool:
        """Store ``value`` of ``nbytes``; False (nothing changed) when it exceeds the budget."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if nbytes > self.capacity:
            return False
        old = self._entries.pop((key, mm_hash), None)
        if old is not None:
            self.bytes -= old[1]
        evicted: list[str] = []
        while self.bytes + nbytes > self.capacity:
            (_, gone_hash), (_, gone_bytes) = self._entries.popitem(last=False)
            self.bytes -= gone_bytes
            evicted.append(gone_hash)
        self._entries[(key, mm_hash)] = (value, nbytes)
        self.bytes += nbytes
        self.stores += 1
        self.evictions += len(evicted)
        if self.listener is not None:
            if evicted:
                self.listener.evicted(evicted)
            self.listener.stored(mm_hash, nbytes)
        return True
