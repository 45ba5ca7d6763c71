"""Start-up measurements of P1: how long a computation takes on this machine, at best.

The engine chooses some settings by timing the alternatives at start-up (``--dtype auto`` in
``engine/execution/dtype.py``, ``--cpu-linear auto`` in ``engine/execution/cpu_linear.py``); both
time them here.

Invariant: :func:`best_time` runs ``fn`` once untimed (kernels chosen, caches and the
allocator warm), then ``repeat`` times, and returns the shortest run: the least noisy
estimate on a shared machine, where other work only ever adds time.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def best_time(fn: Callable[[], object], repeat: int) -> float:
    """Seconds of the fastest of ``repeat`` timed calls of ``fn``, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(max(1, repeat)):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
