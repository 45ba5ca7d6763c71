"""P1's host allocator settings: freed tensor memory stays mapped for the next step.

Every CPU tensor torch makes comes from glibc ``malloc``. By default glibc serves a block
above a (dynamic) threshold with a fresh ``mmap`` and returns it with ``munmap`` when it is
freed, and gives the top of its heap back to the kernel once more than a threshold is free.
A step of the engine allocates and frees the same large activations and K/V gathers again
and again, so a step may fault the same pages in anew. Measured on the medium LLaVA
(``benchmarks/medium_llava.py``), 16 decode rows at 400 tokens of context, 1 thread, three
alternating runs (``benchmarks/README.md``): 113-162 ms a decode step with glibc's defaults
(in the slow runs ``index_select``, the K/V gathers, took ~2 ms a call instead of ~0.45),
109-114 ms with the memory kept. vLLM's CPU build preloads tcmalloc for the same reason.

:func:`keep_freed_memory` sets glibc's ``M_MMAP_THRESHOLD`` to its maximum (blocks below it
come from the heap, whose freed blocks are reused) and ``M_TRIM_THRESHOLD`` out of reach (the
heap is never shrunk). Invariants:
- Called once per P1 process (``entrypoints/engine.py`` and every tensor-parallel worker,
  ``engine/execution/tensor_parallel.py``) before the model is loaded; idempotent.
- The cost is resident memory: the process keeps the peak of its host allocations mapped
  (as a caching allocator does) instead of returning it between steps.
- Only glibc has ``mallopt``; elsewhere (musl, macOS) it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("mmis.engine")

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # the largest glibc takes on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = (1 << 31) - 1  # an int: never trim


def keep_freed_memory() -> bool:
    """Apply the module's ``mallopt`` settings; ``False`` (logged) where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.info("host memory: no glibc mallopt (%s); the allocator keeps its defaults", name)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        log.warning("host memory: glibc refused the mallopt settings; allocator defaults kept")
    return ok
