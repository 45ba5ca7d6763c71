"""mmis/cpus.py: the CPUs a process may use, from a fake cgroup tree (one piece, no processes)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mmis import cpus


def _tree(tmp_path: Path, group: str, limits: dict[str, str]) -> tuple[str, str]:
    proc = tmp_path / "proc/self"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(f"0::{group}\n")
    root = tmp_path / "cgroup"
    for path, value in limits.items():
        (root / path).mkdir(parents=True, exist_ok=True)
        (root / path / "cpu.max").write_text(value + "\n")
    (root / group.lstrip("/")).mkdir(parents=True, exist_ok=True)
    return str(root), str(tmp_path / "proc")


@pytest.fixture
def many_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(64)))


@pytest.mark.usefixtures("many_cores")
def test_the_quota_of_the_containers_cgroup_bounds_a_large_node(tmp_path: Path) -> None:
    root, proc = _tree(tmp_path, "/kubepods/pod1/ctr", {"kubepods/pod1/ctr": "400000 100000"})
    assert cpus.usable_cpus(root, proc) == 4


@pytest.mark.usefixtures("many_cores")
def test_an_ancestors_quota_counts_and_a_fraction_rounds_down(tmp_path: Path) -> None:
    root, proc = _tree(
        tmp_path,
        "/kubepods/pod1/ctr",
        {"kubepods/pod1": "250000 100000", "kubepods/pod1/ctr": "max 100000"},
    )
    assert cpus.usable_cpus(root, proc) == 2


@pytest.mark.usefixtures("many_cores")
def test_no_quota_and_unreadable_files_leave_the_affinity(tmp_path: Path) -> None:
    root, proc = _tree(tmp_path, "/ctr", {"ctr": "max 100000"})
    assert cpus.usable_cpus(root, proc) == 64
    assert cpus.usable_cpus(str(tmp_path / "absent"), str(tmp_path / "absent")) == 64


@pytest.mark.usefixtures("many_cores")
def test_a_quota_below_one_cpu_still_gives_one(tmp_path: Path) -> None:
    root, proc = _tree(tmp_path, "/ctr", {"ctr": "50000 100000"})
    assert cpus.usable_cpus(root, proc) == 1


def test_cgroup_v1_quota(tmp_path: Path, many_cores: None) -> None:
    v1 = tmp_path / "cgroup/cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cpus.usable_cpus(str(tmp_path / "cgroup"), str(tmp_path / "noproc")) == 3


def test_the_engine_leaves_the_front_ends_their_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpus, "usable_cpus", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpus.engine_threads(1) == 1
    assert cpus.engine_threads(4) == 1  # never below one
    assert cpus.engine_threads() == 2
    assert cpus.rank_threads(None, 2) == 1
    assert cpus.rank_threads(6, 2) == 3


def test_omp_num_threads_is_honoured_when_no_flag_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpus, "usable_cpus", lambda: 8)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpus.rank_threads(None) == 3
    assert cpus.rank_threads(5) == 5  # the flag wins
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")
    assert cpus.rank_threads(None) == 8
