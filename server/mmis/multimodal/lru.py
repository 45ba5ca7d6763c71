"""A byte-budget LRU map, the one eviction policy both multimodal caches share.

Invariants:
- Every operation is O(1) amortised (an ``OrderedDict``: oldest first, newest last), except
  that :meth:`ByteBudgetLRU.put` evicts as many entries as it must.
- ``total_bytes`` is always the sum of the stored entries' sizes and never exceeds
  ``capacity_bytes``.
- :meth:`peek`, :meth:`contains` and ``in`` never change the order; :meth:`touch` and
  :meth:`get` make an entry the newest; :meth:`put` stores an entry as the newest.
- An entry larger than the whole budget is never stored (both caches follow this rule, so
  they agree that such an item is served uncached); storing under an existing key replaces
  the entry.
- Evicted keys are returned in eviction order, oldest first, so two caches fed the same
  operations evict the same keys in the same order.
- Not thread-safe: each owner serialises its own calls.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ByteBudgetLRU(Generic[K, V]):
    """Least-recently-used map whose entries each carry a byte size."""

    def __init__(self, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise TypeError(f"capacity_bytes must be an int, got {type(capacity_bytes).__name__}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._total = 0

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def total_bytes(self) -> int:
        return self._total

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        """Keys from least to most recently used."""
        return iter(list(self._entries))

    def contains(self, key: K) -> bool:
        """Whether ``key`` is stored; does not change the order."""
        return key in self._entries

    def fits(self, nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` may be stored at all."""
        return 0 <= nbytes <= self._capacity

    def peek(self, key: K) -> V | None:
        """The value under ``key`` (or ``None``); does not change the order."""
        entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def size_of(self, key: K) -> int | None:
        """The byte size recorded for ``key`` (or ``None``); does not change the order."""
        entry = self._entries.get(key)
        return None if entry is None else entry[1]

    def touch(self, key: K) -> bool:
        """Make ``key`` the most recently used; ``False`` if it is not stored."""
        if key not in self._entries:
            return False
        self._entries.move_to_end(key)
        return True

    def get(self, key: K) -> V | None:
        """The value under ``key`` (or ``None``), made the most recently used."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: K, value: V, nbytes: int) -> list[K]:
        """Store ``value`` as the newest entry; return the keys evicted to make room.

        An existing entry under ``key`` is replaced. An entry that can never fit is not
        stored, and a stale entry under its key is dropped (and reported as evicted).
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        old = self._entries.pop(key, None)
        if old is not None:
            self._total -= old[1]
        if nbytes > self._capacity:
            return [key] if old is not None else []
        evicted: list[K] = []
        while self._total + nbytes > self._capacity:
            victim, (_, victim_bytes) = self._entries.popitem(last=False)
            self._total -= victim_bytes
            evicted.append(victim)
        self._entries[key] = (value, nbytes)
        self._total += nbytes
        return evicted

    def pop(self, key: K) -> V | None:
        """Remove ``key``; return its value, or ``None`` if it was not stored."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._total -= entry[1]
        return entry[0]

    def clear(self) -> list[K]:
        """Remove every entry; return the removed keys, oldest first."""
        keys = list(self._entries)
        self._entries.clear()
        self._total = 0
        return keys
