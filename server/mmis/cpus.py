"""The CPUs a process may really use, and P1's compute threads at defaults.

torch sizes its intra-op pool from the machine's physical cores. In a container that is the
node's count, not the container's: a 4-CPU pod on a 64-core node would start 32 OpenMP
threads and be throttled by its quota for most of every step. Beside a front end on the same
CPUs (``mmis serve``), every extra thread that spins between P1's small ops also takes a core
from P0's image work (benchmarks/README.md, "Where a request's host time goes").

Invariants:
- :func:`usable_cpus` is the smaller of the scheduler affinity and the cgroup CPU quota
  (cgroup v2 ``cpu.max`` of this process's cgroup and every ancestor, or v1
  ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), the quota rounded down, at least 1. Anything
  unreadable counts as no limit; it never raises.
- :func:`engine_threads` is what P1 runs with when neither ``--threads`` nor ``OMP_NUM_THREADS``
  is given: the usable CPUs
  less ``frontend_cpus`` (the front-end processes sharing them; ``mmis serve`` passes its
  ``--api-servers``, ``mmis engine`` alone 0), at least 1; under tensor parallelism each rank
  takes an equal share (:func:`rank_threads`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["engine_threads", "rank_threads", "usable_cpus"]


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _v2_quota(root: Path, proc: Path) -> float | None:
    try:
        lines = (proc / "self/cgroup").read_text().splitlines()
    except OSError:
        return None
    path = next((line[3:] for line in lines if line.startswith("0::")), None)
    if path is None:
        return None
    limits: list[float] = []
    group = (root / path.lstrip("/")).resolve()
    while True:
        try:
            quota, period = (group / "cpu.max").read_text().split()[:2]
            if quota != "max" and int(period) > 0:
                limits.append(int(quota) / int(period))
        except (OSError, ValueError):
            pass
        if group == root.resolve() or group.parent == group:
            break
        group = group.parent
    return min(limits) if limits else None


def _v1_quota(root: Path) -> float | None:
    for name in ("cpu", "cpu,cpuacct"):
        try:
            quota = int((root / name / "cpu.cfs_quota_us").read_text())
            period = int((root / name / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        if quota > 0 and period > 0:
            return quota / period
    return None


def usable_cpus(cgroup_root: str = "/sys/fs/cgroup", proc_root: str = "/proc") -> int:
    """The CPUs this process may use: affinity and cgroup quota, the smaller, at least 1."""
    cpus = _affinity()
    root = Path(cgroup_root)
    quota = _v2_quota(root, Path(proc_root))
    if quota is None:
        quota = _v1_quota(root)
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota)))
    return max(1, cpus)


def engine_threads(frontend_cpus: int = 0) -> int:
    """P1's intra-op threads at defaults: :func:`usable_cpus` less the front ends', at least 1."""
    return max(1, usable_cpus() - max(0, frontend_cpus))


def rank_threads(threads: int | None, ranks: int = 1) -> int:
    """One rank's intra-op threads: ``threads`` (``--threads``), else a valid
    ``OMP_NUM_THREADS`` (the variable torch itself honours), else :func:`engine_threads`,
    shared equally by ``ranks`` processes, at least 1."""
    if not threads:
        omp = os.environ.get("OMP_NUM_THREADS", "")
        threads = int(omp) if omp.isdigit() and int(omp) > 0 else engine_threads()
    return max(1, threads // max(1, ranks))
