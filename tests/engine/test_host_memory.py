"""``engine/execution/host_memory.py``: after :func:`keep_freed_memory` a large CPU tensor comes
from the
heap and its memory stays mapped after it is freed (glibc's own counters, ``mallinfo2``); a
fresh process without it gets the same tensor from ``mmap`` and gives it back.

Each side runs in a fresh interpreter (the settings are process-wide)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import ctypes, json, sys, torch

class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
applied = None
if sys.argv[1] == "keep":
    from mmis.engine.execution.host_memory import keep_freed_memory
    applied = keep_freed_memory()
before = libc.mallinfo2()
tensor = torch.empty(16 << 18).fill_(1.0)  # 16 MiB, touched
during = libc.mallinfo2()
del tensor
after = libc.mallinfo2()
print(json.dumps({
    "applied": applied,
    "mmapped": during.hblkhd - before.hblkhd,
    "heap": during.arena - before.arena,
    "heap_after_free": after.arena - before.arena,
}))
"""
MIB = 1 << 20


def probe(mode: str) -> dict[str, int]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    result: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_freed_step_memory_stays_mapped() -> None:
    default, kept = probe("default"), probe("keep")
    # glibc's defaults: the 16 MiB tensor is its own mapping, unmapped when freed
    assert default["mmapped"] >= 16 * MIB and default["heap_after_free"] < MIB, default
    assert kept["applied"] is True
    assert kept["mmapped"] == 0 and kept["heap"] >= 16 * MIB, kept
    assert kept["heap_after_free"] >= 16 * MIB, kept  # not trimmed: the next step reuses it
