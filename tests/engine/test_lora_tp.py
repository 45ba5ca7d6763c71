"""LoRA's memory and tensor parallelism (issue 47's engine leftovers), on the tiny LLaVA.

- KV sizing from memory holds the LoRA slots aside: with ``--enable-lora`` the pool is smaller
  by exactly their bytes in whole blocks, and those bytes are what the manager then allocates
  (``engine/lora/manager.py`` ``slot_bytes``; memory readings scripted as in
  ``test_kv_sizing.py``, the profiling forward real).
- ``--tensor-parallel-size 2`` on CPU (a real ``mmis engine``, rank 1 a real worker over
  gloo) under ``--enable-lora``: one batch mixing an adapter of the language model, one that
  also reaches the vision tower and projector, and the base, on the same image, answers the
  greedy ids of the same batch through a one-rank engine core (in this process), and the
  three differ. An adapter whose files are deleted after it was loaded still serves there:
  rank 0 sends its host copy with the slot write, and the worker reads no files (it used
  to, and its failed read ended the engine).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the adapter maker

from engine_harness import EngineHarness
from engine_inputs import ModelKit, image, kit_for
from lora_adapters import LM, TOWER, make_adapter
from tp_sizing_rank import BLOCK, ScriptedMemory

from mmis.engine.config import EngineConfig
from mmis.engine.execution.kv_sizing import gpu_kv_blocks, lora_slot_bytes, worst_case
from mmis.engine.execution.model import load_adapter
from mmis.engine.lora.manager import LoRAManager
from mmis.protocol.messages import EngineCoreRequest

pytestmark = pytest.mark.model

PROMPT = "Describe this image in one short sentence, please."
MAX_NEW = 6


def test_lora_slots_shrink_the_sized_kv_pool_by_their_bytes(tiny_dirs: dict[str, Path]) -> None:
    adapter = load_adapter(tiny_dirs["llava"], "cpu", torch.float32, fuse=False)
    unit = adapter.kv_cache_spec(BLOCK).bytes_per_block

    def blocks(cfg: EngineConfig) -> int:
        memory = ScriptedMemory(100 * unit, 2000 * unit, [10 * unit])
        got, _, _ = gpu_kv_blocks(
            adapter,
            0.5,
            block_size=BLOCK,
            max_num_batched_tokens=256,
            max_num_seqs=4,
            max_model_len=512,
            memory=memory,
            worst=worst_case(cfg, None, None, adapter),
        )
        return got

    plain = EngineConfig(enforce_eager=True, max_loras=4, max_lora_rank=16)
    lora = EngineConfig(enforce_eager=True, enable_lora=True, max_loras=4, max_lora_rank=16)
    reserved = lora_slot_bytes(lora, adapter)
    assert lora_slot_bytes(plain, adapter) == 0
    assert blocks(plain) == 890  # 1000 - 100 used - 10 peak
    assert reserved > unit  # more than one block: the difference is visible
    assert blocks(plain) - blocks(lora) == -(-reserved // unit)
    # the bytes held aside are the bytes the manager allocates
    manager = LoRAManager(adapter.model, max_loras=4, max_rank=16)
    held = sum(m.lora_a.nbytes + m.lora_b_t.nbytes for m in manager.layers.values())
    assert reserved == held


@pytest.fixture(scope="module")
def kit(tiny_dirs: dict[str, Path]) -> ModelKit:
    return kit_for("llava", tiny_dirs["llava"])


@pytest.fixture(scope="module")
def adapters(kit: ModelKit, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-tp")
    return {
        "lm": make_adapter(kit.path, root / "lm", LM, rank=8, alpha=16, seed=1),
        "tower": make_adapter(kit.path, root / "tower", TOWER["llava"], rank=4, alpha=8, seed=2),
    }


def _batch(kit: ModelKit) -> list[EngineCoreRequest]:
    """The same image and prompt under ``lm`` (id 1), ``tower`` (id 2) and the base."""
    base = kit.request(PROMPT, [image(5)], max_tokens=MAX_NEW)
    return [
        msgspec.structs.replace(base, request_id=f"r-{name}", lora_name=name, lora_id=lora_id)
        for name, lora_id in (("lm", 1), ("tower", 2), (None, 0))
    ]


def _one_rank(kit: ModelKit, adapters: dict[str, Path]) -> dict[str, list[int]]:
    """The batch's greedy ids through an in-process engine core of one rank."""
    from mmis.engine.builder import make_core
    from mmis.engine.execution.runner import ModelRunner

    cfg = EngineConfig(enable_lora=True, max_loras=2, max_lora_rank=8)
    ours = load_adapter(kit.path, "cpu", torch.float32, fuse=False)
    core = make_core(cfg, ModelRunner.create(ours, num_blocks=64, block_size=16))
    calls = core.utilities()
    for lora_id, (name, path) in enumerate(adapters.items(), start=1):
        calls["load_lora_adapter"](name, lora_id, str(path))
    for request in _batch(kit):
        core.add_request(request)
    tokens: dict[str, list[int]] = {}
    while core.has_work():
        for out in core.step():
            assert out.error is None, out.error
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


@pytest.fixture(scope="module")
def one_rank(kit: ModelKit, adapters: dict[str, Path]) -> dict[str, list[int]]:
    return _one_rank(kit, adapters)


@pytest.fixture(scope="module")
def two_ranks(kit: ModelKit) -> Iterator[EngineHarness]:
    args = ["--tensor-parallel-size", "2", "--enable-lora", "--max-loras", "2"]
    args += ["--max-lora-rank", "8", "--num-kv-blocks", "64", "--max-num-batched-tokens", "24"]
    with EngineHarness(kit.path, *args) as eng:
        yield eng


@pytest.mark.slow
def test_two_ranks_serve_a_mixed_lora_batch_as_one_rank(
    kit: ModelKit,
    adapters: dict[str, Path],
    two_ranks: EngineHarness,
    one_rank: dict[str, list[int]],
) -> None:
    assert "tensor parallel: 2 ranks (cpu)" in two_ranks.log_text()
    for lora_id, (name, path) in enumerate(adapters.items(), start=1):
        loaded: Any = two_ranks.call("load_lora_adapter", name, lora_id, str(path))
        assert loaded["lora_id"] == lora_id
    results = two_ranks.run(*_batch(kit))  # together: one step mixes the three
    got = {r.request_id: r.token_ids for r in results}
    for r in results:
        assert r.error is None, r.error
    assert got == one_rank
    assert len({tuple(ids) for ids in got.values()}) == 3  # each adapter really applied


@pytest.mark.slow
def test_an_adapter_whose_files_are_gone_still_serves_on_both_ranks(
    kit: ModelKit,
    adapters: dict[str, Path],
    two_ranks: EngineHarness,
    one_rank: dict[str, list[int]],
    tmp_path: Path,
) -> None:
    """Loaded, then its directory deleted (a volume remounted, a sync job's cleanup): its
    first slot write happens after, on rank 0 from its host copy, on rank 1 from what rank 0
    sends (``engine/lora/manager.py``). Same weights as ``lm``: the same ids."""
    copy = shutil.copytree(adapters["lm"], tmp_path / "gone")
    loaded: Any = two_ranks.call("load_lora_adapter", "gone", 3, str(copy))
    assert loaded["lora_id"] == 3
    shutil.rmtree(copy)
    request = msgspec.structs.replace(
        _batch(kit)[0], request_id="r-gone", lora_name="gone", lora_id=3
    )
    (result,) = two_ranks.run(request)
    assert result.error is None, result.error
    assert result.token_ids == one_rank["r-lm"]
    assert two_ranks.alive
