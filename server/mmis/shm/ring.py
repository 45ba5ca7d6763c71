"""Ring-order space accounting of the data region (writer-private, no shared memory).

Positions are *logical* byte counters that only grow; the physical offset in the data region
is ``position % capacity``. ``tail`` is the start of the oldest live extent, ``head`` the end
of the newest, so ``used = head - tail``.

Invariants:
- Extents are allocated at ``head`` and released only from the front (oldest first), so the
  live space is always the single logical interval ``[tail, head)`` and ``used <= capacity``.
- An extent never wraps around the end of the data region: if it would, the bytes up to the
  end are skipped and charged to that extent (``start`` includes the pad), so releasing it
  returns them too.
- When the ring becomes empty both counters jump to the next lap boundary, so the next
  extent starts at physical offset 0 and large payloads do not pay a pad.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class Extent:
    """One live allocation. ``issued`` counts descriptors handed out for it."""

    handle_id: int
    slot: int
    start: int  # logical, including any pad before ``offset``
    end: int  # logical, exclusive
    offset: int  # physical offset of the payload within the data region
    created: float
    issued: int = 1

    @property
    def charged(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ShmStats:
    """A snapshot of the store, for tests and metrics. Bytes include alignment and pads."""

    capacity: int
    used: int
    free: int
    live_handles: int
    max_handles: int
    outstanding_descriptors: int
    reclaimed_bytes: int
    reclaimed_handles: int
    expired_bytes: int
    expired_handles: int


class Ring:
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"ring capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.head = 0
        self.tail = 0
        self._extents: deque[Extent] = deque()

    def __len__(self) -> int:
        return len(self._extents)

    def __iter__(self) -> Iterator[Extent]:
        return iter(self._extents)

    @property
    def used(self) -> int:
        return self.head - self.tail

    def _pad(self, size: int) -> int:
        phys = self.head % self.capacity
        return self.capacity - phys if phys + size > self.capacity else 0

    def fits(self, size: int) -> bool:
        return self.used + self._pad(size) + size <= self.capacity

    def push(self, handle_id: int, slot: int, size: int, now: float) -> Extent:
        """Allocate ``size`` bytes at the head; the caller checked :meth:`fits`."""
        if not self.fits(size):
            raise ValueError(f"{size} bytes do not fit (used {self.used} of {self.capacity})")
        start = self.head
        offset = (start + self._pad(size)) % self.capacity
        end = start + self._pad(size) + size
        ext = Extent(handle_id, slot, start, end, offset, now)
        self._extents.append(ext)
        self.head = end
        return ext

    def front(self) -> Extent | None:
        return self._extents[0] if self._extents else None

    def pop_front(self) -> Extent:
        ext = self._extents.popleft()
        self.tail = ext.end
        if not self._extents:
            lap = -(-self.head // self.capacity) * self.capacity
            self.head = self.tail = lap
        return ext
