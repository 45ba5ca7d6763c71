"""The single writer (P0) of a shared-memory object store segment.

Protocol (no ZMQ message is ever needed for acknowledgements):

1. :meth:`ShmWriter.put` copies a dict of arrays into the data ring, fills the slot record
   ``handle_id % slot_count`` (``STATE = LIVE`` last) and returns a signed
   :class:`ShmAddress`. :meth:`ShmWriter.share` hands out the same descriptor again for a
   later cache hit; the writer counts every descriptor it issues for a handle.
2. The reader acknowledges each descriptor it receives by storing
   ``(handle_id << 16) | count`` into the slot's ack word in the shared header.
3. The writer scans ack words lazily (on every ``put`` and on :meth:`reclaim`) and reclaims
   extents in ring order while the oldest one has ``count >= issued``; reclaiming bumps the
   slot's generation, so any later read of that descriptor is rejected as stale.
4. A ``put`` that finds no space polls for acknowledgements for at most ``put_timeout_s``.
   Then it force-expires the oldest live extents created at least ``expire_after_s`` ago
   (generation bumped, counted in ``expired_*``), and if that is still not enough it raises
   :class:`ShmStoreFullError`; the caller then sends the payload inline. A payload larger
   than the store raises :class:`ShmPayloadTooLargeError` at once. Nothing blocks forever.

Invariants: one writer object per segment, guarded by a lock (P0 may call from several
threads); the writer owns the segment and key files, holds the segment's ownership lock while
it lives and unlinks both files on :meth:`close`. Before creating its segment it reclaims
the segments of writers that died (:mod:`mmis.shm.ownership`), and it waits a bounded
``reserve_timeout_s`` for their memory to be released.
"""

from __future__ import annotations

import errno
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from mmis.protocol.messages import ShmAddress
from mmis.shm import layout, ownership, payload, signing
from mmis.shm.errors import (
    ShmPayloadTooLargeError,
    ShmSegmentError,
    ShmStoreFullError,
    StaleHandleError,
    UnknownSegmentError,
)
from mmis.shm.ring import Extent, Ring, ShmStats

DEFAULT_DIRECTORY = "/dev/shm"


class ShmWriter:
    def __init__(
        self,
        capacity_bytes: int,
        *,
        directory: str | Path = DEFAULT_DIRECTORY,
        name: str | None = None,
        max_handles: int = 4096,
        put_timeout_s: float = 0.05,
        expire_after_s: float = 60.0,
        reserve_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if capacity_bytes < layout.ALIGN:
            raise ValueError(f"capacity_bytes must be at least {layout.ALIGN}")
        if max_handles < 1 or put_timeout_s < 0 or expire_after_s < 0:
            raise ValueError("max_handles must be >= 1 and timeouts must be >= 0")
        self.directory = Path(directory)
        self.reclaimed_stale = ownership.reclaim_stale(self.directory)
        capacity = layout.align_up(capacity_bytes)
        self.segment, self._map = self._create(
            name, capacity, max_handles, reserve_timeout_s, clock, sleep
        )
        self.key = signing.new_key()
        self.key_path = signing.key_path(self.directory, self.segment)
        try:
            signing.write_key_file(self.key_path, self.key)
        except BaseException:
            (self.directory / self.segment).unlink(missing_ok=True)
            self._map.close()
            raise
        self._ring = Ring(capacity)
        self._live: dict[int, Extent] = {}
        self._next_handle = 1
        self._put_timeout_s = put_timeout_s
        self._expire_after_s = expire_after_s
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._closed = False
        self._reclaimed = [0, 0]  # bytes, handles
        self._expired = [0, 0]

    def _create(
        self,
        name: str | None,
        capacity: int,
        max_handles: int,
        reserve_timeout_s: float,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
    ) -> tuple[str, layout.SegmentMapping]:
        """Create and lock the segment. A full directory (``ENOSPC``: a reclaimed segment's
        memory is freed once its reader drops it) is retried until ``reserve_timeout_s``;
        a lost creation race is retried under a new name (when the name is ours to pick)."""
        deadline = clock() + reserve_timeout_s
        while True:
            segment = layout.check_segment_name(name or f"mmis-{secrets.token_hex(8)}")
            try:
                return segment, layout.create(self.directory / segment, capacity, max_handles)
            except ownership.LostRaceError:
                if name is not None:
                    raise
            except OSError as exc:
                if exc.errno != errno.ENOSPC or clock() >= deadline:
                    raise
                sleep(0.1)  # a bounded wait for memory another process is releasing

    # -- public API ---------------------------------------------------------------------

    def put(self, data: Mapping[str, Any]) -> ShmAddress:
        """Store ``data`` (name -> array) and return its signed descriptor (issued once)."""
        plan = payload.plan(data)
        size = layout.align_up(plan.size)
        if size > self._ring.capacity:
            raise ShmPayloadTooLargeError(
                f"payload of {plan.size} bytes exceeds the store capacity of "
                f"{self._ring.capacity} bytes; send it inline"
            )
        with self._lock:
            self._check_open()
            self._make_room(size)
            handle_id = self._next_handle
            if handle_id > layout.MAX_HANDLE_ID:
                raise ShmStoreFullError(f"segment {self.segment!r} ran out of handle ids")
            self._next_handle += 1
            slot = handle_id % self._map.slot_count
            ext = self._ring.push(handle_id, slot, size, self._clock())
            self._live[handle_id] = ext
            start = self._map.data_offset + ext.offset
            try:
                payload.write(self._map.mm, start, plan)
            except BaseException:
                ext.issued = 0  # never handed out: the next reclaim frees it in ring order
                raise
            rec = self._map.slots[slot]
            rec[layout.HANDLE] = handle_id
            rec[layout.OFFSET] = start
            rec[layout.LENGTH] = plan.size
            rec[layout.STATE] = layout.LIVE
            return self._descriptor(handle_id, start, plan.size, int(rec[layout.GENERATION]))

    def share(self, address: ShmAddress) -> ShmAddress:
        """Issue ``address`` once more (a later cache hit); the reader must ack it too."""
        with self._lock:
            self._check_open()
            self._check_mine(address)
            ext = self._live.get(address.handle_id)
            if ext is None or int(self._map.slots[ext.slot, layout.GENERATION]) != (
                address.generation
            ):
                raise StaleHandleError(f"handle {address.handle_id} is no longer live")
            if ext.issued >= layout.ACK_COUNT_MAX:
                raise ShmStoreFullError(f"handle {address.handle_id} reached its descriptor limit")
            ext.issued += 1
            return address

    def reclaim(self) -> int:
        """Reclaim acknowledged extents in ring order; return the bytes freed."""
        with self._lock:
            self._check_open()
            return self._reclaim()

    def stats(self) -> ShmStats:
        with self._lock:
            outstanding = sum(e.issued - self._acked(e) for e in self._ring)
            return ShmStats(
                capacity=self._ring.capacity,
                used=self._ring.used,
                free=self._ring.capacity - self._ring.used,
                live_handles=len(self._ring),
                max_handles=self._map.slot_count,
                outstanding_descriptors=max(outstanding, 0),
                reclaimed_bytes=self._reclaimed[0],
                reclaimed_handles=self._reclaimed[1],
                expired_bytes=self._expired[0],
                expired_handles=self._expired[1],
            )

    def close(self) -> None:
        """Unmap and unlink the segment and its key file (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            (self.directory / self.segment).unlink(missing_ok=True)
            self.key_path.unlink(missing_ok=True)
            self._map.close()  # releases the ownership lock last

    def __enter__(self) -> ShmWriter:
        return self

    def __exit__(
        self, tp: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- internals (lock held) ----------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ShmSegmentError(f"segment {self.segment!r} is closed")

    def _check_mine(self, address: ShmAddress) -> None:
        if address.segment != self.segment:
            raise UnknownSegmentError(
                f"descriptor names segment {address.segment!r}, not {self.segment!r}"
            )
        signing.verify(self.key, address)

    def _descriptor(self, handle_id: int, offset: int, length: int, generation: int) -> ShmAddress:
        sig = signing.sign(self.key, self.segment, offset, length, handle_id, generation)
        return ShmAddress(self.segment, offset, length, handle_id, generation, sig)

    def _acked(self, ext: Extent) -> int:
        word = int(self._map.acks[ext.slot])
        return word & layout.ACK_COUNT_MAX if word >> layout.ACK_COUNT_BITS == ext.handle_id else 0

    def _retire(self, ext: Extent, state: int) -> None:
        rec = self._map.slots[ext.slot]
        rec[layout.GENERATION] = int(rec[layout.GENERATION]) + 1
        rec[layout.STATE] = state
        del self._live[ext.handle_id]

    def _reclaim(self) -> int:
        freed = 0
        while (ext := self._ring.front()) is not None and self._acked(ext) >= ext.issued:
            self._ring.pop_front()
            self._retire(ext, layout.FREE)
            freed += ext.charged
            self._reclaimed[0] += ext.charged
            self._reclaimed[1] += 1
        return freed

    def _fits(self, size: int) -> bool:
        return len(self._ring) < self._map.slot_count and self._ring.fits(size)

    def _make_room(self, size: int) -> None:
        self._reclaim()
        if self._fits(size):
            return
        deadline = self._clock() + self._put_timeout_s
        delay = 1e-4
        while (now := self._clock()) < deadline:
            self._sleep(min(delay, deadline - now))
            delay = min(delay * 2, 5e-3)
            self._reclaim()
            if self._fits(size):
                return
        self._expire(size, self._clock())
        if not self._fits(size):
            s = self._ring
            raise ShmStoreFullError(
                f"no room for {size} bytes in segment {self.segment!r} after "
                f"{self._put_timeout_s}s (used {s.used} of {s.capacity} bytes, "
                f"{len(s)} live handles); send the payload inline"
            )

    def _expire(self, size: int, now: float) -> None:
        """Force-expire the oldest extents older than the deadline until ``size`` fits."""
        while not self._fits(size) and (ext := self._ring.front()) is not None:
            if self._acked(ext) >= ext.issued:
                self._reclaim()
                continue
            if now - ext.created < self._expire_after_s:
                return
            self._ring.pop_front()
            self._retire(ext, layout.EXPIRED)
            self._expired[0] += ext.charged
            self._expired[1] += 1
