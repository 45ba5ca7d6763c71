"""P0's allocator settings (``frontend/client/media/allocator.py``), in a fresh interpreter.

A photo's large buffers, allocated and freed on worker threads as P0's executors do, touch
new pages every time at glibc's defaults and none once :func:`keep_image_buffers` ran; an
operator's own ``MALLOC_*`` setting leaves glibc alone.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from mmis.frontend.client.media.allocator import OPERATOR_KNOBS, operator_tuned

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)

PHOTOS = """
import json, resource, sys, threading
from mmis.frontend.client.media.allocator import keep_image_buffers
applied = keep_image_buffers() if sys.argv[1] == "tune" else None
def photo():  # the decoded image and two copies of it, 28 MiB each, written
    buffers = [b"\\x01" * (28 << 20) for _ in range(3)]
    del buffers
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    worker = threading.Thread(target=photo)
    worker.start()
    worker.join()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps([applied, faults]))
"""


def _photos(mode: str, **env: str) -> tuple[bool | None, list[int]]:
    clean = {k: v for k, v in os.environ.items() if k not in OPERATOR_KNOBS}
    clean.pop("GLIBC_TUNABLES", None)
    out = subprocess.run(
        [sys.executable, "-c", PHOTOS, mode],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    applied, faults = json.loads(out.stdout)
    return applied, faults


def test_a_photos_buffers_are_reused_not_faulted_in_again() -> None:
    applied, faults = _photos("tune")
    assert applied is True
    assert max(faults[1:]) < 500, faults  # 84 MiB are 21,504 pages: none touched anew


def test_the_operators_own_malloc_settings_win() -> None:
    assert operator_tuned({"MALLOC_ARENA_MAX": "4"})
    assert operator_tuned({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"})
    assert not operator_tuned({"GLIBC_TUNABLES": "glibc.rtld.nns=2", "PATH": "/bin"})
    applied, faults = _photos("tune", MALLOC_ARENA_MAX="8")  # as glibc's defaults do:
    assert applied is False and min(faults[1:]) > 5000, faults  # unmapped, faulted in again
