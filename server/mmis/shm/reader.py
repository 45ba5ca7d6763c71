"""The reader (P1) of one shared-memory object store segment.

The reader dereferences descriptors and acknowledges them; it never allocates or frees.

Invariants:
- A descriptor is accepted only if, in this order: it names this reader's segment
  (:class:`UnknownSegmentError`), its HMAC-SHA256 signature matches its fields under the
  segment key (:class:`ForgedHandleError`; a tampered offset or length lands here), its
  extent lies inside the data region, and the slot record still holds the same handle,
  generation, offset and length in the LIVE state (:class:`StaleHandleError`: the space was
  reclaimed or force-expired).
- ``read(copy=False)`` returns read-only numpy views over the mapping: valid until the
  descriptor is acknowledged. ``read(copy=True)`` copies, then re-validates the record so a
  force-expiry racing the copy is reported as stale rather than returning reused bytes.
- The reader is the only writer of the ack words. :meth:`ShmReader.ack` increments the
  count for the descriptor's handle (one ack per descriptor received) and never writes over
  the word of a newer handle; acknowledging a stale descriptor is a no-op returning False.
- The key comes from the explicit ``key`` argument, else from the 0600 key file beside the
  segment.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy.typing as npt

from mmis.protocol.messages import ShmAddress
from mmis.shm import layout, payload, signing
from mmis.shm.errors import ShmSegmentError, StaleHandleError, UnknownSegmentError

DEFAULT_DIRECTORY = "/dev/shm"


class ShmReader:
    def __init__(
        self,
        segment: str,
        *,
        directory: str | Path = DEFAULT_DIRECTORY,
        key: bytes | None = None,
    ) -> None:
        self.segment = layout.check_segment_name(segment)
        self.directory = Path(directory)
        if key is not None and len(key) != signing.KEY_BYTES:
            raise ShmSegmentError(f"segment key must be {signing.KEY_BYTES} bytes")
        self._map = layout.attach(self.directory / self.segment)
        try:
            if key is None:
                key = signing.read_key_file(signing.key_path(self.directory, self.segment))
        except BaseException:
            self._map.close()
            raise
        self._key = key
        self._lock = threading.Lock()
        self._closed = False

    def validate(self, address: ShmAddress) -> int:
        """Raise a typed error unless ``address`` may be dereferenced; return its slot."""
        self._authenticate(address)
        slot = address.handle_id % self._map.slot_count
        self._check_live(address, slot)
        return slot

    def read(self, address: ShmAddress, *, copy: bool = False) -> dict[str, npt.NDArray[Any]]:
        """The payload's arrays: zero-copy views, or owned copies with ``copy=True``."""
        slot = self.validate(address)
        arrays = payload.read(self._map.mm, address.offset, address.length, copy)
        if copy:
            self._check_live(address, slot)
        return arrays

    def ack(self, address: ShmAddress) -> bool:
        """Acknowledge one received descriptor; False if its space is already gone."""
        self._authenticate(address)
        slot = address.handle_id % self._map.slot_count
        with self._lock:
            try:
                self._check_live(address, slot)
            except StaleHandleError:
                return False
            word = int(self._map.acks[slot])
            owner = word >> layout.ACK_COUNT_BITS
            if owner > address.handle_id:
                return False
            count = (word & layout.ACK_COUNT_MAX) + 1 if owner == address.handle_id else 1
            self._map.acks[slot] = (address.handle_id << layout.ACK_COUNT_BITS) | min(
                count, layout.ACK_COUNT_MAX
            )
            return True

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._map.close()

    def __enter__(self) -> ShmReader:
        return self

    def __exit__(
        self, tp: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- checks -------------------------------------------------------------------------

    def _authenticate(self, address: ShmAddress) -> None:
        if self._closed:
            raise ShmSegmentError(f"reader of segment {self.segment!r} is closed")
        if address.segment != self.segment:
            raise UnknownSegmentError(
                f"descriptor names segment {address.segment!r}; this reader serves {self.segment!r}"
            )
        signing.verify(self._key, address)
        lo, hi = self._map.data_offset, self._map.data_offset + self._map.data_capacity
        if not (
            lo <= address.offset
            and address.length > 0
            and address.offset + address.length <= hi
            and 0 < address.handle_id <= layout.MAX_HANDLE_ID
        ):
            raise StaleHandleError(
                f"descriptor for handle {address.handle_id} lies outside the data region"
            )

    def _check_live(self, address: ShmAddress, slot: int) -> None:
        rec = [int(x) for x in self._map.slots[slot]]
        if (
            rec[layout.HANDLE] != address.handle_id
            or rec[layout.GENERATION] != address.generation
            or rec[layout.STATE] != layout.LIVE
            or rec[layout.OFFSET] != address.offset
            or rec[layout.LENGTH] != address.length
        ):
            raise StaleHandleError(
                f"handle {address.handle_id} (generation {address.generation}) in segment "
                f"{self.segment!r} was reclaimed or expired; resend the payload inline"
            )
