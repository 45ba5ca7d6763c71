"""``--dtype`` and KV pool sizing (``engine/execution/kv_sizing.py``) of a real ``mmis engine``.

- ``auto`` follows ``/proc/cpuinfo`` on CPU and the checkpoint's dtype on CUDA; an explicit
  ``bfloat16`` loads a bf16 model whose engine still answers, with a KV pool sized by
  ``--kv-cache-gb`` to exactly the blocks of 2-byte entries that budget holds.
- A budget below one max-length sequence is refused with a message naming the flag; on a
  CPU device ``--gpu-memory-utilization`` falls back to the default, logged.
- The CUDA paths (``--gpu-memory-utilization`` profiling, ``auto`` on CUDA) run only where
  CUDA is.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_harness import EngineHarness

from mmis.config import ConfigError, GiB
from mmis.engine.config import DEFAULT_KV_BLOCKS, EngineConfig
from mmis.engine.execution.dtype import (
    DtypeError,
    bf16_matmul_faster,
    checkpoint_dtype,
    cpu_flags,
    resolve_dtype,
)
from mmis.engine.execution.kv_sizing import (
    KVSizingError,
    blocks_from_budget,
    plan_kv_pool,
    profile_step,
)
from mmis.engine.execution.model import load_adapter
from mmis.protocol.messages import EngineCoreRequest, SamplingParams

CUDA = pytest.mark.cuda  # skipped without a device (tests/conftest.py); scripts/gpu-check runs them
CPU = torch.device("cpu")


def run_engine(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mmis", "engine", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def kv_block_bytes(model_dir: Path, block_size: int, itemsize: int) -> int:
    text = json.loads((model_dir / "config.json").read_text())["text_config"]
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    kv_heads = text.get("num_key_value_heads") or heads
    return 2 * text["num_hidden_layers"] * block_size * kv_heads * head_dim * itemsize


def test_auto_dtype_on_cpu_follows_the_bf16_flags(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_tile\n")
    assert "avx512_bf16" in cpu_flags(cpuinfo)

    def auto(flags: Callable[[], frozenset[str]], faster: bool) -> torch.dtype:
        return resolve_dtype("auto", CPU, tmp_path, flags=flags, bf16_faster=lambda: faster)

    # bfloat16 needs both the CPU flags and a measured win
    assert auto(lambda: cpu_flags(cpuinfo), True) is torch.bfloat16
    assert auto(lambda: cpu_flags(cpuinfo), False) is torch.float32
    assert auto(lambda: frozenset({"avx2"}), True) is torch.float32
    assert isinstance(bf16_matmul_faster(rows=4, width=64, repeat=2), bool)  # the real probe
    here = resolve_dtype("auto", CPU, tmp_path)
    if not {"amx_bf16", "avx512_bf16"} & cpu_flags():
        assert here is torch.float32  # this machine: no bf16 units, nothing measured
    else:
        assert here in (torch.bfloat16, torch.float32)
    assert resolve_dtype("bfloat16", CPU, tmp_path) is torch.bfloat16


def test_checkpoint_dtype_is_what_auto_means_on_cuda(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert checkpoint_dtype(tmp_path) is torch.float16
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"dtype": "bfloat16"}}))
    assert checkpoint_dtype(tmp_path) is torch.bfloat16
    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_dtype(tmp_path) is torch.float32


def test_a_bad_dtype_is_refused() -> None:
    with pytest.raises(ConfigError, match="--dtype must be one of auto, bfloat16"):
        EngineConfig(dtype="int8")
    done = run_engine("--dtype", "int8")
    assert done.returncode != 0
    assert "invalid choice: 'int8'" in done.stderr


def test_bfloat16_on_a_gpu_without_it_names_the_gpu_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pre-Ampere GPU (V100, T4) lacks bfloat16; no lent device (H100/H200) does, so this
    one check runs here with torch's two CUDA queries stubbed (``mmis serve`` turns the
    :class:`DtypeError` into its one start-up line: tests/entrypoints/test_startup_errors.py)."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100-SXM2-16GB")
    with pytest.raises(DtypeError) as caught:
        resolve_dtype("bfloat16", torch.device("cuda"), tmp_path)
    message = str(caught.value)
    assert "Tesla V100" in message and "compute capability 8.0" in message
    assert "use --dtype float16, or --dtype auto" in message
    assert "\n" not in message


def test_a_budget_below_one_max_length_sequence_is_refused() -> None:
    assert blocks_from_budget(10 * 1024, 1024, max_model_len=64, block_size=16) == 10
    with pytest.raises(KVSizingError) as refused:
        blocks_from_budget(4 * 1024, 1024, max_model_len=64, block_size=16)
    message = str(refused.value)
    assert "--gpu-memory-utilization leaves" in message
    assert "4 blocks of 1024 bytes" in message and "needs 5" in message
    with pytest.raises(KVSizingError, match="0 blocks"):
        blocks_from_budget(-(1 << 30), 1024, max_model_len=64, block_size=16)


@pytest.mark.model
def test_kv_precedence_and_gpu_utilization_on_cpu(
    tiny_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    adapter = load_adapter(tiny_dirs["llava"], "cpu", torch.float32)
    assert next(adapter.model.parameters()).device.type == "cpu"
    both = EngineConfig(num_kv_blocks=7, kv_cache_gb=1.0, gpu_memory_utilization=0.5)
    assert plan_kv_pool(both, adapter, 64).num_blocks == 7
    by_gb = plan_kv_pool(EngineConfig(kv_cache_gb=0.5, gpu_memory_utilization=0.5), adapter, 64)
    assert (by_gb.budget_bytes, by_gb.source) == (GiB // 2, "--kv-cache-gb")
    with caplog.at_level(logging.WARNING, logger="mmis.engine"):
        plan = plan_kv_pool(EngineConfig(gpu_memory_utilization=0.9), adapter, 64)
    assert (plan.num_blocks, plan.source) == (DEFAULT_KV_BLOCKS, "default")
    assert "applies to CUDA only" in caplog.text


@pytest.mark.model
def test_the_profiling_step_is_the_largest_the_settings_allow(tiny_dirs: dict[str, Path]) -> None:
    adapter = load_adapter(tiny_dirs["llava"], "cpu", torch.float32)
    runner, step = profile_step(
        adapter, num_tokens=100, max_num_seqs=2, block_size=16, max_model_len=30
    )
    assert [s.num_tokens for s in step.scheduled] == [25, 25, 25, 25]  # 4 x <= max_model_len
    assert runner.pool.num_blocks == 1 + 4 * 2
    out = runner.execute(step)
    assert sorted(out.sampled_token_ids) == [f"profile-{i}" for i in range(4)]


@pytest.mark.model
@pytest.mark.slow
def test_bfloat16_engine_answers_with_a_pool_sized_by_kv_cache_gb(
    tiny_dirs: dict[str, Path],
) -> None:
    model_dir = tiny_dirs["llava"]
    per_block = kv_block_bytes(model_dir, 16, 2)
    budget = 37 * per_block + per_block // 2  # holds 37 blocks of bf16 entries
    args = ["--dtype", "bfloat16", "--kv-cache-gb", repr(budget / GiB), "--block-size", "16"]
    with EngineHarness(model_dir, *args) as engine:
        stats = engine.call("stats")
        assert stats["kv_block_bytes"] == per_block
        assert stats["num_kv_blocks"] == 37 - 1  # block 0 is reserved
        log_text = engine.log_text()
        assert "in bfloat16" in log_text
        assert "engine ready: 37 KV blocks of 16 tokens (--kv-cache-gb, bfloat16)" in log_text
        # on CPU: no profile, the fixed batch limits with the CPU's step
        assert "batch limits: at most 64 sequences (default) and 512 tokens a step" in log_text
        params = SamplingParams(max_tokens=5, ignore_eos=True)
        [result] = engine.run(EngineCoreRequest("bf16", list(range(3, 40)), [], params))
    assert result.error is None
    assert len(result.token_ids) == 5


@CUDA
@pytest.mark.model
def test_auto_dtype_on_cuda_is_the_checkpoints(tiny_dirs: dict[str, Path]) -> None:
    model_dir = tiny_dirs["llava"]
    cuda = torch.device("cuda")
    assert resolve_dtype("auto", cuda, model_dir) is checkpoint_dtype(model_dir)
    adapter = load_adapter(model_dir, cuda, resolve_dtype("bfloat16", cuda, model_dir))
    assert next(adapter.model.parameters()).device.type == "cuda"
    assert adapter.kv_cache_spec(16).dtype is torch.bfloat16


@CUDA
@pytest.mark.model
@pytest.mark.slow
def test_gpu_memory_utilization_sizes_the_pool_and_fills_it(tiny_dirs: dict[str, Path]) -> None:
    model_dir = tiny_dirs["llava"]
    args = ["--device", "cuda", "--gpu-memory-utilization", "0.5", "--max-model-len", "256"]
    with EngineHarness(model_dir, *args, "--max-num-seqs", "8") as engine:
        stats = engine.call("stats")
        total = torch.cuda.mem_get_info()[1]
        assert 0 < stats["num_kv_blocks"] * stats["kv_block_bytes"] < total * 0.5
        assert "(--gpu-memory-utilization" in engine.log_text()
        assert "KV sizing:" in engine.log_text()
        assert "at most 8 sequences (set) and" in engine.log_text()
        assert "tokens a step (profile)" in engine.log_text()
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        requests = [EngineCoreRequest(f"g{i}", list(range(3, 50)), [], params) for i in range(8)]
        results = engine.run(*requests)
    assert all(r.error is None and len(r.token_ids) == 200 for r in results)


@CUDA
@pytest.mark.model
def test_gpu_memory_utilization_too_small_is_refused(tiny_dirs: dict[str, Path]) -> None:
    done = run_engine(
        "--model", str(tiny_dirs["llava"]), "--device", "cuda", "--gpu-memory-utilization", "1e-6"
    )
    assert done.returncode != 0
    assert "--gpu-memory-utilization leaves" in done.stderr
    assert "Traceback" not in done.stderr
