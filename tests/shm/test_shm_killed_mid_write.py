"""Issue 45 item 4: a P0 (an SHM writer) SIGKILLed in the middle of a write leaks nothing.

The writer runs in a real child process; its second ``put`` stops inside the payload copy
(the extent taken, the payload half written, the slot not yet live, the writer's lock held)
and the child is SIGKILLed right there, as an OOM kill would. Beside it lives a sibling
writer (another P0 of the same pod) and P1's reader set, which had mapped the dead segment.
The restarted P0's writer reclaims the dead segment and its key (never the sibling's), P1's
reader drops its mapping, and the dead writer's descriptor is then a typed error, never a read
of freed memory. The end-to-end twin, with real ``mmis frontend`` processes under load, is
S16 in ``tests/e2e/test_scenarios_multi_p0_e2e.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest

from mmis.protocol.messages import ShmAddress
from mmis.shm import ShmReaderSet, ShmWriter
from mmis.shm.errors import ShmHandleError

CHILD = """
import sys, time
import msgspec, numpy as np
from mmis.shm import ShmWriter, payload

writer = ShmWriter(1 << 20, directory=sys.argv[1])
first = writer.put({"x": np.arange(64, dtype=np.int64)})
print(writer.segment, msgspec.json.encode(first).decode(), flush=True)

def stop_mid_copy(buf, start, plan):
    buf[start : start + 64] = b"\\xab" * 64  # the first bytes of the payload only
    print("mid-write", flush=True)
    time.sleep(600)

payload.write = stop_mid_copy
writer.put({"y": np.ones(4096, dtype=np.float32)})
"""


def _names(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


def _mapped(segment: str) -> bool:
    return segment in Path(f"/proc/{os.getpid()}/maps").read_text()


@pytest.fixture
def child(shm_dir: Path):
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(shm_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def test_a_writer_killed_mid_write_is_reclaimed_by_its_restart(
    shm_dir: Path, child: subprocess.Popen[str]
) -> None:
    sibling = ShmWriter(1 << 20, directory=shm_dir)  # the pod's other P0, alive throughout
    readers = ShmReaderSet(shm_dir)  # P1
    restarted: ShmWriter | None = None
    try:
        assert child.stdout is not None
        dead, encoded = child.stdout.readline().split(" ", 1)
        first = msgspec.json.decode(encoded, type=ShmAddress)
        assert readers.receive(first)["x"].tolist() == list(range(64))  # P1 maps it
        kept = sibling.put({"z": np.arange(8, dtype=np.int32)})
        assert child.stdout.readline().strip() == "mid-write"
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        assert {dead, f"{dead}.key"} <= _names(shm_dir) and _mapped(dead)  # left behind

        restarted = ShmWriter(1 << 20, directory=shm_dir)  # the P0 restarted on the same dir
        assert restarted.reclaimed_stale == [dead]
        assert _names(shm_dir) == {
            sibling.segment,
            f"{sibling.segment}.key",
            restarted.segment,
            f"{restarted.segment}.key",
        }
        assert readers.prune() == [dead]  # P1's janitor pass: the memory is really freed
        assert not _mapped(dead)
        with pytest.raises(ShmHandleError):
            readers.receive(first)  # the dead writer's descriptor: a typed error
        assert readers.receive(kept)["z"].tolist() == list(range(8))  # the sibling unharmed
    finally:
        readers.close()
        sibling.close()
        if restarted is not None:
            restarted.close()
