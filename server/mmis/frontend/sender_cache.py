"""P0's shadow of P1's multimodal receiver cache: metadata only, same budget, same LRU.

Invariants:
- The shadow stores no tensors: ``mm_hash -> ShadowEntry`` (the item's exact byte size, as
  :func:`mmis.multimodal.sizing.item_nbytes` computes it on both sides, and its
  placeholder information), in the same :class:`ByteBudgetLRU` the receiver uses.
- Per request the shadow applies exactly what P1's ``ReceiverCache.resolve`` applies: first
  touch every item that is cached, then record the items that were sent with data, in
  request order. So while nothing drifts, both caches hold the same keys in the same order,
  and a request's own items never evict each other when they fit together.
- :meth:`SenderCache.is_cached` and :meth:`SenderCache.lookup` never change the LRU order.
  ``is_cached`` is a single dict membership test, so the asyncio output handler may call it
  while the render worker mutates the shadow; every *mutation* happens on the single
  multimodal render worker (invalidations reach it through ``PendingInvalidations``).
- An item larger than the whole budget is never recorded (P1 never stores it either); it is
  served uncached, with its data, every time.
- Clearing on a change of P1's cache epoch is requested through ``PendingInvalidations``,
  which applies it on the render worker like any other invalidation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mmis.multimodal.lru import ByteBudgetLRU


@dataclasses.dataclass(frozen=True)
class ShadowEntry:
    """What P0 remembers about an item P1 holds: enough to skip the processor's pixel work."""

    nbytes: int
    placeholder_length: int
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ShadowItem:
    """One item of a request as recorded after rendering it."""

    mm_hash: str
    entry: ShadowEntry


@dataclasses.dataclass(frozen=True)
class SenderCacheStats:
    hits: int
    misses: int
    recorded: int
    oversize: int
    evictions: int
    invalidations: int
    clears: int
    entries: int
    total_bytes: int
    capacity_bytes: int


class SenderCache:
    """The metadata-only shadow of the receiver cache, on P0's render worker."""

    def __init__(self, capacity_bytes: int) -> None:
        self._lru: ByteBudgetLRU[str, ShadowEntry] = ByteBudgetLRU(capacity_bytes)
        self.hits = 0
        self.misses = 0
        self.recorded = 0
        self.oversize = 0
        self.evictions = 0
        self.invalidations = 0
        self.clears = 0

    @property
    def capacity_bytes(self) -> int:
        return self._lru.capacity_bytes

    def __len__(self) -> int:
        return len(self._lru)

    def keys(self) -> list[str]:
        """Cached hashes, least recently used first."""
        return list(self._lru)

    def is_cached(self, mm_hash: str) -> bool:
        """Whether the shadow believes P1 holds ``mm_hash``. No order change, no counters."""
        return mm_hash in self._lru

    def get(self, mm_hash: str) -> ShadowEntry | None:
        """The entry for ``mm_hash``, without changing the order or counting."""
        return self._lru.peek(mm_hash)

    def lookup(self, mm_hashes: Sequence[str]) -> list[ShadowEntry | None]:
        """Entries for a request's items (``None`` = send the data), counting hits/misses.

        Does not change the LRU order: :meth:`record_request` does that for the whole
        request, the way P1 will.
        """
        entries = [self._lru.peek(h) for h in mm_hashes]
        hits = sum(entry is not None for entry in entries)
        self.hits += hits
        self.misses += len(entries) - hits
        return entries

    def record_request(self, items: Sequence[ShadowItem]) -> list[str]:
        """Apply one request: touch every cached item, then record the others in order.

        Returns the hashes evicted to make room. Items larger than the budget are skipped.
        """
        fresh: list[ShadowItem] = []
        for item in items:
            if not self._lru.touch(item.mm_hash):
                fresh.append(item)
        evicted: list[str] = []
        for item in fresh:
            if not self._lru.fits(item.entry.nbytes):
                self.oversize += 1
                continue
            evicted.extend(self._lru.put(item.mm_hash, item.entry, item.entry.nbytes))
            self.recorded += 1
        self.evictions += len(evicted)
        return evicted

    def invalidate(self, mm_hash: str) -> bool:
        """Forget ``mm_hash`` (P1 reported it missing or evicted); ``True`` if it was cached."""
        if self._lru.pop(mm_hash) is None:
            return False
        self.invalidations += 1
        return True

    def invalidate_many(self, mm_hashes: Iterable[str]) -> int:
        """Forget every hash in ``mm_hashes``; return how many were cached."""
        return sum(self.invalidate(h) for h in mm_hashes)

    def clear(self) -> None:
        """Forget everything (P1 restarted, or the cache was reset)."""
        self._lru.clear()
        self.clears += 1

    def stats(self) -> SenderCacheStats:
        return SenderCacheStats(
            hits=self.hits,
            misses=self.misses,
            recorded=self.recorded,
            oversize=self.oversize,
            evictions=self.evictions,
            invalidations=self.invalidations,
            clears=self.clears,
            entries=len(self._lru),
            total_bytes=self._lru.total_bytes,
            capacity_bytes=self._lru.capacity_bytes,
        )
