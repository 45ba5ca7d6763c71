"""KV sizing from device memory (``engine/execution/kv_sizing.py``) and the step size it settles on
(``engine/batch_limits.py``), on CPU: every profiling step is a real forward of the tiny
model; only the memory readings are scripted (``tp_sizing_rank.ScriptedMemory``, in units of one KV
block's bytes), since a CPU has no allocator statistics. The CUDA readings themselves are
covered by the ``cuda``-marked tests of ``test_engine_dtype_kv.py``.

Under tensor parallelism, two real processes over gloo: rank 1 mirrors each profiling step
and the ranks agree on the minimum, so a step size one rank cannot afford is refused by both
and the pool is the smaller rank's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tp_sizing_rank import BLOCK, ScriptedMemory

from mmis.engine.execution import kv_sizing
from mmis.engine.execution.kv_sizing import KVSizingError, gpu_kv_blocks
from mmis.engine.execution.model import load_adapter
from mmis.engine.execution.tensor_parallel import free_port

pytestmark = pytest.mark.model


def size(model_dir: Path, used: int, peaks: list[int], given: int | None = None) -> tuple:
    """``gpu_kv_blocks`` at 0.5 of 2000 units, ``used`` in use; (blocks, tokens, steps)."""
    adapter = load_adapter(model_dir, "cpu", torch.float32)
    unit = adapter.kv_cache_spec(BLOCK).bytes_per_block
    memory = ScriptedMemory(used * unit, 2000 * unit, [p * unit for p in peaks])
    blocks, budget, tokens = gpu_kv_blocks(
        adapter,
        0.5,
        block_size=BLOCK,
        max_num_batched_tokens=given,
        max_num_seqs=None,
        max_model_len=512,
        memory=memory,
    )
    assert budget == blocks * unit
    return blocks, tokens, memory.steps


def test_the_largest_step_whose_activations_fit_is_taken(tiny_dirs: dict[str, Path]) -> None:
    # room 1000 - 100 = 900: 8192 tokens peak at 200 (x8 > 900), 4096 at 100 (x8 <= 900)
    assert size(tiny_dirs["llava"], 100, [200, 100]) == (800, 4096, 2)
    # none fits: the last choice is taken whatever it needs
    assert size(tiny_dirs["llava"], 100, [200, 150, 120]) == (780, 2048, 3)


def test_a_given_step_size_is_profiled_alone(tiny_dirs: dict[str, Path]) -> None:
    assert size(tiny_dirs["llava"], 100, [200], given=8192) == (700, 8192, 1)


def test_too_little_memory_is_refused_and_a_huge_pool_capped(
    tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(KVSizingError, match="needs 33"):  # 4 blocks; 512 tokens need 1 + 32
        size(tiny_dirs["llava"], 995, [1, 1, 1])
    monkeypatch.setattr(kv_sizing, "MAX_SIZED_KV_BLOCKS", 100)
    assert size(tiny_dirs["llava"], 100, [10]) == (100, 8192, 1)


@pytest.mark.slow
def test_two_ranks_agree_on_the_smaller_pool_and_step(tiny_dirs: dict[str, Path]) -> None:
    # rank 0 alone would take 8192 tokens and 850 blocks; rank 1 cannot afford 8192
    # (room 700, peak 100 x 8) and holds 650 blocks at 4096: both must end there
    readings = [
        {"fraction": 0.5, "total": 2000, "used": 100, "peaks": [50, 25]},
        {"fraction": 0.5, "total": 2000, "used": 300, "peaks": [100, 50]},
    ]
    script = Path(__file__).with_name("tp_sizing_rank.py")
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(script.parent)}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), port, str(tiny_dirs["qwen2-vl"]), json.dumps(x)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r, x in enumerate(readings)
    ]
    outs = []
    try:
        for p in ranks:
            stdout, stderr = p.communicate(timeout=240)
            assert p.returncode == 0, stderr[-3000:]
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in ranks:
            p.kill()
    assert outs[0] == {"blocks": 650, "budget_blocks": 650, "tokens": 4096, "steps": 2}
    assert outs[1] == {"blocks": 650, "steps": 2}
