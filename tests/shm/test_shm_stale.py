"""Stale segments: a writer that died leaves files a new writer reclaims; a live one keeps its own.

Writers run in real child processes (killed with SIGKILL, as the OOM killer or kubelet would);
ownership is the kernel's ``flock`` on the segment file (``mmis/shm/ownership.py``). A reader
set drops the mapping of a removed segment, so its tmpfs memory is really freed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from mmis.shm import ShmReaderSet, ShmWriter, ownership

WRITER = """
import sys, time
from mmis.shm import ShmWriter
w = ShmWriter(1 << 20, directory=sys.argv[1])
print(w.segment, flush=True)
time.sleep(600)
"""


class ChildWriter:
    def __init__(self, directory: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(directory)], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        self.segment = self.proc.stdout.readline().strip()
        assert self.segment.startswith("mmis-"), self.segment

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


@pytest.fixture
def children() -> Iterator[list[ChildWriter]]:
    made: list[ChildWriter] = []
    yield made
    for child in made:
        if child.proc.poll() is None:
            child.kill()


def _names(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


def _mapped(path: Path) -> bool:
    return str(path) in Path(f"/proc/{os.getpid()}/maps").read_text()


def test_dead_writers_files_are_reclaimed_live_ones_kept(
    shm_dir: Path, children: list[ChildWriter]
) -> None:
    dead, alive = ChildWriter(shm_dir), ChildWriter(shm_dir)
    children += [dead, alive]
    dead.kill()
    assert {dead.segment, f"{dead.segment}.key", alive.segment} <= _names(shm_dir)
    (shm_dir / "mmis-orphan.key").write_bytes(b"k")  # a writer died between its two files
    (shm_dir / "unrelated").write_bytes(b"x")  # not ours: never touched
    writer = ShmWriter(1 << 20, directory=shm_dir)
    try:
        assert writer.reclaimed_stale == [dead.segment]
        names = _names(shm_dir)
        assert dead.segment not in names and f"{dead.segment}.key" not in names
        assert "mmis-orphan.key" not in names
        assert {alive.segment, f"{alive.segment}.key", writer.segment, "unrelated"} <= names
        # the new writer's own segment is locked too: a second scan keeps it
        assert ownership.reclaim_stale(shm_dir) == []
    finally:
        writer.close()
        alive.kill()
        assert ownership.reclaim_stale(shm_dir) == [alive.segment]
        (shm_dir / "unrelated").unlink()


def test_a_reader_drops_the_mapping_of_a_removed_segment(shm_dir: Path) -> None:
    writer = ShmWriter(1 << 20, directory=shm_dir)
    readers = ShmReaderSet(shm_dir)
    try:
        address = writer.put({"x": np.arange(16, dtype=np.int64)})
        assert readers.receive(address)["x"].tolist() == list(range(16))
        path = shm_dir / writer.segment
        assert _mapped(path)
        assert readers.prune() == []  # still there: kept
        writer.close()
        readers.start(prune_interval_s=0.05)
        deadline = time.monotonic() + 10
        while _mapped(path):  # also matches "<path> (deleted)"
            assert time.monotonic() < deadline, "the removed segment is still mapped"
            time.sleep(0.02)  # polling the janitor thread's effect; not a synchronisation
    finally:
        readers.close()
        writer.close()


def test_reserving_waits_for_memory_being_released(shm_dir: Path) -> None:
    """ENOSPC while reserving (the old segment still mapped somewhere) is retried, bounded."""
    calls: list[float] = []
    real = os.posix_fallocate

    def full_twice(fd: int, offset: int, size: int) -> None:
        calls.append(time.monotonic())
        if len(calls) <= 2:
            raise OSError(28, "No space left on device")
        real(fd, offset, size)

    os.posix_fallocate = full_twice  # type: ignore[assignment]
    try:
        writer = ShmWriter(1 << 20, directory=shm_dir, reserve_timeout_s=5)
        writer.close()
        assert len(calls) == 3
        calls.clear()
        with pytest.raises(OSError):
            ShmWriter(1 << 20, directory=shm_dir, reserve_timeout_s=0)
        assert len(calls) == 1  # no budget: the first failure is final
    finally:
        os.posix_fallocate = real  # type: ignore[assignment]
    assert _names(shm_dir) == set()
