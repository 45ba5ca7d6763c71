"""The binary layout of one shared-memory segment, and mapping it into a process.

A segment is one file (default directory ``/dev/shm``) mapped read-write by the writer (P0)
and by its reader (P1). All integers are little-endian ``uint64``; every table is 64-byte
aligned and the data region is page aligned::

    [header: magic, version, slot_count, slot_table, ack_table, data_offset, data_capacity]
    [slot table: slot_count records of 8 words, written ONLY by the writer]
    [ack table:  slot_count words,             written ONLY by the reader]
    [data region: data_capacity bytes, a ring of payloads]

Invariants:
- Every shared word has exactly one writing process, so no atomic read-modify-write is ever
  needed across processes; each word is written with one aligned 64-bit store (single-copy
  atomic on x86-64 and arm64).
- Slot record words: ``HANDLE`` (the handle id living there), ``GENERATION`` (bumped every
  time the slot leaves the live state: reclaimed or force-expired), ``STATE`` (FREE / LIVE /
  EXPIRED), ``OFFSET`` and ``LENGTH`` (absolute file offset and byte length of the payload).
  The writer stores ``STATE = LIVE`` last, after the payload and the other words.
- Ack word of slot ``s``: ``(handle_id << ACK_COUNT_BITS) | count`` — how many descriptors of
  that handle the reader has acknowledged. A word naming an older handle counts as zero
  acknowledgements for the current one, so the writer never has to clear it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from mmis.shm import ownership
from mmis.shm.errors import ShmSegmentError, UnknownSegmentError

MAGIC = int.from_bytes(b"MMISSHM1", "little")
VERSION = 1
HEADER_WORDS = 8
SLOT_WORDS = 8
HANDLE, GENERATION, STATE, OFFSET, LENGTH = range(5)
FREE, LIVE, EXPIRED = 0, 1, 2
ACK_COUNT_BITS = 16
ACK_COUNT_MAX = (1 << ACK_COUNT_BITS) - 1
MAX_HANDLE_ID = (1 << (64 - ACK_COUNT_BITS)) - 1
ALIGN = 64
PAGE = mmap.PAGESIZE


def align_up(value: int, alignment: int = ALIGN) -> int:
    return (value + alignment - 1) // alignment * alignment


def check_segment_name(segment: object) -> str:
    """A segment name is a plain file name: no path separators, no leading dot."""
    if (
        not isinstance(segment, str)
        or not segment
        or len(segment) > 200
        or segment.startswith(".")
        or not all(c.isascii() and (c.isalnum() or c in "-_.") for c in segment)
    ):
        raise UnknownSegmentError(f"invalid segment name {segment!r}")
    return segment


@dataclass
class SegmentMapping:
    """One process's mapping of a segment, with numpy views of its tables."""

    path: Path
    mm: mmap.mmap
    slots: npt.NDArray[np.uint64]  # shape (slot_count, SLOT_WORDS)
    acks: npt.NDArray[np.uint64]  # shape (slot_count,)
    data_offset: int
    data_capacity: int
    lock_fd: int | None = None  # the writer's: its ownership lock (mmis.shm.ownership)

    @property
    def slot_count(self) -> int:
        return int(self.slots.shape[0])

    def close(self) -> None:
        """Unmap (if a caller still holds zero-copy views, leave the unmap to the GC), then
        release the ownership lock, if this mapping holds it."""
        del self.slots, self.acks
        with contextlib.suppress(BufferError):
            self.mm.close()
        if self.lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.lock_fd)
            self.lock_fd = None


def _views(path: Path, mm: mmap.mmap) -> SegmentMapping:
    if len(mm) < HEADER_WORDS * 8:
        raise ShmSegmentError(f"{path} is too small to be an mmis segment")
    header = np.frombuffer(mm, dtype="<u8", count=HEADER_WORDS)
    magic, version, slot_count, slot_table, ack_table, data_offset, capacity = (
        int(x) for x in header[:7]
    )
    del header
    if magic != MAGIC or version != VERSION:
        raise ShmSegmentError(f"{path} is not an mmis segment of version {VERSION}")
    if data_offset + capacity > len(mm) or ack_table + slot_count * 8 > data_offset:
        raise ShmSegmentError(f"{path} has an inconsistent header")
    slots = np.ndarray((slot_count, SLOT_WORDS), dtype="<u8", buffer=mm, offset=slot_table)
    acks = np.ndarray((slot_count,), dtype="<u8", buffer=mm, offset=ack_table)
    return SegmentMapping(path, mm, slots, acks, data_offset, capacity)


def create(path: Path, data_capacity: int, slot_count: int) -> SegmentMapping:
    """Create a new segment file (exclusively, mode 0600) with its memory reserved up front,
    holding its ownership lock (:func:`mmis.shm.ownership.lock_new`) until it is closed.

    Reserving with ``posix_fallocate`` turns "tmpfs is full" into an ``OSError`` here instead
    of a ``SIGBUS`` on the first write into an unbacked page.
    """
    slot_table = align_up(HEADER_WORDS * 8)
    ack_table = align_up(slot_table + slot_count * SLOT_WORDS * 8)
    data_offset = align_up(ack_table + slot_count * 8, PAGE)
    size = data_offset + data_capacity
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        ownership.lock_new(fd, path)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            os.unlink(path)
            raise
        mm = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise
    header = np.frombuffer(mm, dtype="<u8", count=HEADER_WORDS)
    header[:7] = [0, VERSION, slot_count, slot_table, ack_table, data_offset, data_capacity]
    header[0] = MAGIC  # last: a reader never sees a half-written header as valid
    del header
    mapping = _views(path, mm)
    mapping.lock_fd = fd
    return mapping


def attach(path: Path) -> SegmentMapping:
    """Map an existing segment read-write (the reader writes its ack words)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError as exc:
        raise UnknownSegmentError(f"segment {path.name!r} does not exist in {path.parent}") from exc
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise ShmSegmentError(f"{path} is empty")
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    try:
        return _views(path, mm)
    except Exception:
        mm.close()
        raise
