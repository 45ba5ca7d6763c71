"""The encoder keeps only the vision tower and projector resident, and sizes its output cache
from the host memory left (``engine/encoder/loader.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmis.config import GiB
from mmis.engine.encoder.config import EncoderConfig
from mmis.engine.encoder.loader import (
    cache_budget,
    host_available_bytes,
    load_vision_only,
    parameter_bytes,
)
from mmis.engine.execution.model import load_adapter
from mmis.tiny_models.tiny_model import tiny_model_dir


@pytest.mark.model
@pytest.mark.parametrize("family", ["llava", "qwen2-vl"])
def test_only_the_vision_tower_and_projector_stay_resident(family: str) -> None:
    path = str(tiny_model_dir(family))
    adapter = load_vision_only(EncoderConfig(model=path, device="cpu", dtype="float32"), path)
    names = [name for name, _ in adapter.model.named_parameters()]
    assert not [n for n in names if ".layers." in n and "language_model" in n]
    assert not [n for n in names if "lm_head" in n or "embed_tokens" in n]
    assert any("visual" in n or "vision_tower" in n for n in names)
    full = load_adapter(path, "cpu", adapter.dtype, fuse=False)
    assert parameter_bytes(adapter) < parameter_bytes(full) / 2


def _meminfo(tmp_path: Path, available_kib: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_kib} kB\n")
    return path


def test_the_cgroup_limit_bounds_the_available_memory(tmp_path: Path) -> None:
    meminfo = _meminfo(tmp_path, 8 * 1024 * 1024)  # 8 GiB
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert host_available_bytes(meminfo, cgroup) == 8 * GiB  # no cgroup files: the host's
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text(f"{GiB}\n")
    assert host_available_bytes(meminfo, cgroup) == 8 * GiB  # no limit
    (cgroup / "memory.max").write_text(f"{3 * GiB}\n")
    assert host_available_bytes(meminfo, cgroup) == 2 * GiB  # limit - current


def test_cache_gb_wins_else_a_share_of_what_is_available() -> None:
    assert cache_budget(EncoderConfig(cache_gb=0.5), available=8 * GiB) == (GiB // 2, "--cache-gb")
    budget, why = cache_budget(EncoderConfig(), available=8 * GiB)
    assert budget == 4 * GiB and "8.0 GiB available" in why
