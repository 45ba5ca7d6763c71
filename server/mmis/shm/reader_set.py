"""Readers for every segment a P1 receives descriptors from (one per P0 writer).

Invariants:
- A segment is attached lazily, the first time a descriptor names it, from the configured
  directory; its key comes from the explicit ``keys`` mapping, else from its 0600 key file.
- A descriptor naming a segment that does not exist raises :class:`UnknownSegmentError`
  (the name is validated first, so a descriptor can never reach outside the directory).
- ``read``/``ack`` have the same contract as :class:`ShmReader`'s.
- :meth:`ShmReaderSet.receive` is the one resolver of a descriptor on P1: it copies the
  payload out of shared memory *before* acknowledging it, so the arrays never alias space the
  writer may reuse, and the writer's reference count balances. A descriptor whose space was
  reclaimed raises :class:`~mmis.shm.errors.StaleHandleError` (retryable: P1's receiver cache
  reports the item missing and P0 resends it inline, see :mod:`mmis.multimodal.cache`).
- A segment whose file is gone (its writer closed, or died and a new writer reclaimed it,
  :mod:`mmis.shm.ownership`) is detached by :meth:`ShmReaderSet.prune` — every
  ``prune_interval_s`` on the janitor thread once :meth:`start` ran — because a removed
  tmpfs file's memory is freed only when no process maps it any more. Reads and prunes
  take the same lock, so a mapping is never closed under a read.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy.typing as npt

from mmis.protocol.messages import ShmAddress
from mmis.shm.reader import DEFAULT_DIRECTORY, ShmReader


class ShmReaderSet:
    def __init__(
        self,
        directory: str | Path = DEFAULT_DIRECTORY,
        keys: Mapping[str, bytes] | None = None,
    ) -> None:
        self.directory = Path(directory)
        self._keys = dict(keys or {})
        self._readers: dict[str, ShmReader] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._janitor: threading.Thread | None = None

    def start(self, prune_interval_s: float = 1.0) -> None:
        """Prune on a daemon thread every ``prune_interval_s`` until :meth:`close`."""
        if self._janitor is not None:
            return

        def run() -> None:
            while not self._stop.wait(prune_interval_s):
                self.prune()

        self._janitor = threading.Thread(target=run, name="mmis-shm-janitor", daemon=True)
        self._janitor.start()

    def prune(self) -> list[str]:
        """Detach every segment whose file is gone; the names detached."""
        with self._lock:
            gone = [name for name in self._readers if not (self.directory / name).exists()]
            readers = [self._readers.pop(name) for name in gone]
            for reader in readers:
                reader.close()
        return gone

    def reader(self, address: ShmAddress) -> ShmReader:
        with self._lock:
            found = self._readers.get(address.segment)
            if found is None:
                found = ShmReader(
                    address.segment,
                    directory=self.directory,
                    key=self._keys.get(address.segment),
                )
                self._readers[address.segment] = found
            return found

    def read(self, address: ShmAddress, *, copy: bool = False) -> dict[str, npt.NDArray[Any]]:
        return self.reader(address).read(address, copy=copy)

    def ack(self, address: ShmAddress) -> bool:
        return self.reader(address).ack(address)

    def receive(self, address: ShmAddress) -> dict[str, npt.NDArray[Any]]:
        """The descriptor's arrays, owned (copied out), then the descriptor acknowledged."""
        with self._lock:  # no prune between the copy and the ack
            arrays = self.read(address, copy=True)
            self.ack(address)
        return arrays

    def forget(self, segment: str) -> None:
        """Detach a segment whose writer went away (e.g. a P0 restart made a new one)."""
        with self._lock:
            reader = self._readers.pop(segment, None)
        if reader is not None:
            reader.close()

    def close(self) -> None:
        self._stop.set()
        if self._janitor is not None:
            self._janitor.join(timeout=5)
            self._janitor = None
        with self._lock:
            readers, self._readers = list(self._readers.values()), {}
        for reader in readers:
            reader.close()
