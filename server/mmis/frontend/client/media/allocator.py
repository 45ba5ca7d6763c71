"""Keep a photo's large buffers in P0's heap between requests, instead of the kernel's.

Measured on a unique 4-12 MP JPEG (benchmarks/README.md, issue 45): P0 allocates several
24-36 MB buffers per photo (the decoded image, the image processor's array, its channels-first
copy, torchvision's channels-last copy for the resize). At its defaults glibc serves the
largest with fresh ``mmap()``s and gives a heap's free top back to the kernel above its trim
threshold, so every photo touched 40-70 MB of new pages: 10-18 thousand minor page faults and
30-50 ms of kernel CPU per photo, a quarter of P0's CPU there. vLLM's front end runs under
tcmalloc, which keeps freed memory: about 45 faults per photo.

Invariants:
- :func:`keep_image_buffers` runs once per P0 process, at start, before its threads
  (``entrypoints/frontend.py`` ``serve``), and sets with ``mallopt``: ``M_ARENA_MAX`` 1
  (every thread allocates from the main heap: a thread arena's heaps are at most 64 MiB,
  fewer than one photo's buffers, and are unmapped when free), ``M_MMAP_THRESHOLD``
  :data:`MMAP_THRESHOLD` (32 MiB, glibc's ceiling for its own dynamic threshold) and
  ``M_TRIM_THRESHOLD`` :data:`TRIM_THRESHOLD` (256 MiB). It is a no-op (returns ``False``)
  off glibc, or when the operator tuned glibc's allocator through its environment
  (:data:`OPERATOR_KNOBS`, or a ``glibc.malloc`` tunable in ``GLIBC_TUNABLES``): theirs win.
- What it costs: up to :data:`TRIM_THRESHOLD` of freed buffers stay in the process, so P0's
  resident memory stays near its high-water mark instead of falling back after a burst of
  photos (measured: about +0.1-0.2 GiB at c=16 on 4-12 MP photos, benchmarks/README.md). Nothing
  is allocated by this; the per-image limits (``media_max_bytes``, ``media_max_pixels``) bound
  each buffer as before. The threads share one heap's lock; P0's threads mostly hold the GIL.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from collections.abc import Mapping
from typing import Final

M_TRIM_THRESHOLD: Final = -1  # glibc malloc.h
M_MMAP_THRESHOLD: Final = -3
M_ARENA_MAX: Final = -8
MMAP_THRESHOLD: Final = 32 << 20
TRIM_THRESHOLD: Final = 256 << 20
OPERATOR_KNOBS: Final = (
    "MALLOC_ARENA_MAX",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
)


def operator_tuned(environ: Mapping[str, str]) -> bool:
    """Whether glibc's allocator was tuned through the environment (then it is left alone)."""
    return any(k in environ for k in OPERATOR_KNOBS) or "glibc.malloc" in environ.get(
        "GLIBC_TUNABLES", ""
    )


def keep_image_buffers(environ: Mapping[str, str] | None = None) -> bool:
    """Set the arena count and thresholds (see the module docstring); whether all three
    were applied."""
    if operator_tuned(os.environ if environ is None else environ):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = (
        (M_ARENA_MAX, 1),
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
    )
    return all([mallopt(option, value) == 1 for option, value in settings])
