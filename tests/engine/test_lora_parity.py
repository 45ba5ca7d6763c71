"""Multi-LoRA parity at the runner (issue 47's acceptance, engine half): PEFT adapters of
random non-zero weights, made with peft on the tiny LLaVA and Qwen2-VL, served by the model
runner with ``engine/lora/`` (the same ``Driver`` the runner parity tests use).

- A batch mixing 4 adapters and the base gives each request the ids it gets alone (runner).
- Through the engine core (scheduler + runner, ``make_core`` with ``--enable-lora``): the same
  image under an adapter of the language model alone, one that also reaches the vision tower
  and projector, and the base, in one batch: each equals transformers (+ PEFT)'s greedy
  ``generate`` on the same adapter and image, and the three differ; the core's refusals and
  the load / unload / list utility calls.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mmis.engine.execution.model import load_adapter
from mmis.engine.execution.runner import ModelRunner
from mmis.engine.lora.errors import LoRAIdReusedError, LoRAInUseError
from mmis.engine.lora.manager import LoRAManager
from mmis.protocol.encoder import MM_EMBEDS
from mmis.protocol.messages import (
    EngineCoreRequest,
    MultiModalFeature,
    PlaceholderRange,
    SamplingParams,
)

from .conftest import Driver, Family

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the adapter maker
from lora_adapters import LM, TOWER, make_adapter

# name -> (target, rank, alpha, rslora, seed); "tower" reaches the vision side
ADAPTERS: dict[str, tuple[str, int, int, bool, int]] = {
    "lm": (LM, 8, 16, False, 1),
    "tower": ("TOWER", 4, 8, True, 2),
    "lm2": (LM, 2, 4, False, 3),
    "lm3": (LM, 6, 6, False, 4),
}
MAX_NEW = 4


def _base(path: Path) -> Any:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


@dataclasses.dataclass
class Setup:
    family: Family  # hf_model: the base reference; adapter: ours, wrapped
    dirs: dict[str, Path]
    runner: ModelRunner


_SETUPS: dict[str, Setup] = {}
_PEFT: dict[tuple[str, str], Any] = {}


def _setup(name: str, tiny_dirs: dict[str, Path], root: Path) -> Setup:
    if name in _SETUPS:
        return _SETUPS[name]
    from transformers import AutoProcessor

    path = tiny_dirs[name]
    dirs = {}
    for adapter, (target, rank, alpha, rslora, seed) in ADAPTERS.items():
        target = TOWER[name] if target == "TOWER" else target
        dirs[adapter] = make_adapter(
            path, root / name / adapter, target, rank=rank, alpha=alpha, seed=seed, rslora=rslora
        )
    ours = load_adapter(path, "cpu", torch.float32)
    runner = ModelRunner.create(ours, num_blocks=256, block_size=16)
    runner.lora = LoRAManager(ours.model, max_loras=4, max_rank=8)
    for i, (adapter, d) in enumerate(dirs.items(), start=1):
        runner.lora.add(adapter, i, str(d))
    family = Family(name, path, AutoProcessor.from_pretrained(path), _base(path), ours)
    _SETUPS[name] = Setup(family, dirs, runner)
    return _SETUPS[name]


@pytest.fixture(params=["llava", "qwen2-vl"])
def setup(
    request: pytest.FixtureRequest,
    tiny_dirs: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Setup:
    return _setup(request.param, tiny_dirs, tmp_path_factory.mktemp("lora"))


def _with_loras(runner: ModelRunner, loras: dict[str, str | None]) -> ModelRunner:
    """``runner`` whose steps carry each request's adapter (the scheduler's job in P1)."""
    execute = ModelRunner.execute.__get__(runner)

    def run(batch: Any, *args: Any, **kwargs: Any) -> Any:
        rows = [s._replace(lora_name=loras[s.request_id]) for s in batch.scheduled]
        return execute(dataclasses.replace(batch, scheduled=rows), *args, **kwargs)

    runner.execute = run  # type: ignore[method-assign]
    return runner


def _serve(setup: Setup, requests: dict[str, tuple[str | None, int]]) -> dict[str, list[int]]:
    """Greedy ids of ``requests`` (id -> (adapter, image seed)) in one batch."""
    runner = _with_loras(setup.runner, {rid: lora for rid, (lora, _) in requests.items()})
    runner.encoder_outputs.clear()
    try:
        driver = Driver(runner)
        for rid, (_, seed) in requests.items():
            ids, items, _ = setup.family.request("Describe it.", [setup.family.image(seed)])
            driver.add(rid, ids, items, max_tokens=MAX_NEW)
        return driver.run()
    finally:
        del runner.execute  # the class's method again


@torch.inference_mode()
def _peft_reference(setup: Setup, adapter: str, seed: int) -> list[int]:
    from peft import PeftModel

    family = setup.family
    model = _PEFT.get((family.name, adapter))
    if model is None:
        model = PeftModel.from_pretrained(_base(family.path), str(setup.dirs[adapter])).eval()
        _PEFT[family.name, adapter] = model
    inputs = family.inputs("Describe it.", [family.image(seed)])
    out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=[])
    return [int(t) for t in out[0, inputs["input_ids"].shape[1] :].tolist()]


def test_batch_mixing_four_adapters_and_the_base_equals_each_alone(setup: Setup) -> None:
    requests = {f"r-{n or 'base'}": (n, i) for i, n in enumerate([*ADAPTERS, None], start=10)}
    mixed = _serve(setup, requests)
    alone = {rid: _serve(setup, {rid: spec})[rid] for rid, spec in requests.items()}
    assert mixed == alone
    assert len(set(map(tuple, alone.values()))) == len(alone)  # every adapter changes the ids


def _core_request(setup: Setup, rid: str, seed: int, lora: tuple[str, int] | None) -> Any:
    ids, items, _ = setup.family.request("Describe it.", [setup.family.image(seed)])
    features = [
        MultiModalFeature(
            modality="image",
            mm_hash=item.mm_hash,
            placeholder=PlaceholderRange(item.offset, item.length),
            data=item.data,
        )
        for item in items
    ]
    name, lora_id = lora if lora is not None else (None, 0)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return EngineCoreRequest(rid, ids, features, params, lora_name=name, lora_id=lora_id)


def test_engine_core_serves_adapters_and_loads_and_unloads_them(setup: Setup) -> None:
    """The in-process engine core (make_core with --enable-lora): the same image under the
    tower adapter, an LM adapter and the base in one batch, each equal to transformers+PEFT;
    the load / unload / list utility calls; a request for an adapter not loaded (or under
    another id) answered with an invalid_request error; unloading refused while in use."""
    from mmis.engine.builder import make_core
    from mmis.engine.config import EngineConfig

    cfg = EngineConfig(enable_lora=True, max_loras=4, max_lora_rank=8)
    core = make_core(cfg, setup.runner)
    calls = core.utilities()
    assert {e["name"] for e in calls["list_lora_adapters"]()} == set(ADAPTERS)
    lm_id = next(e["lora_id"] for e in calls["list_lora_adapters"]() if e["name"] == "lm")
    tower_id = next(e["lora_id"] for e in calls["list_lora_adapters"]() if e["name"] == "tower")
    core.add_request(_core_request(setup, "t", 21, ("tower", tower_id)))
    core.add_request(_core_request(setup, "l", 21, ("lm", lm_id)))
    core.add_request(_core_request(setup, "b", 21, None))
    core.add_request(_core_request(setup, "x", 21, ("missing", 99)))
    core.add_request(_core_request(setup, "w", 21, ("lm", lm_id + 100)))
    pre = _core_request(setup, "e", 22, ("tower", tower_id))  # pre-encoded: E/PD
    (feature,) = pre.mm_features
    hidden = int(setup.family.adapter.model.config.text_config.hidden_size)
    feature.data = {MM_EMBEDS: np.zeros((feature.placeholder.length, hidden), np.float32)}
    core.add_request(pre)
    with pytest.raises(LoRAInUseError, match="in use by 1 request"):
        calls["unload_lora_adapter"]("lm")
    tokens: dict[str, list[int]] = {r: [] for r in "tlbxwe"}
    errors: dict[str, str] = {}
    codes: dict[str, str] = {}  # what P0 switches on (frontend/api/serving_generate.py)
    while core.has_work():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            if out.error is not None:
                errors[out.request_id] = out.error.message
                codes[out.request_id] = out.error.code
    assert errors == {
        "x": "LoRA adapter 'missing' is not loaded",
        "w": f"LoRA adapter 'lm' has id {lm_id}, not {lm_id + 100}",
        "e": "LoRA adapter 'tower' changes the vision tower: its images cannot come "
        "pre-encoded (E/PD)",
    }
    assert codes == {"x": "lora_not_loaded", "w": "lora_id_mismatch", "e": "invalid_request"}
    assert tokens["t"] == _peft_reference(setup, "tower", 21)
    assert tokens["l"] == _peft_reference(setup, "lm", 21)
    assert tokens["b"] == setup.family.reference("Describe it.", [setup.family.image(21)], MAX_NEW)
    assert len({tuple(tokens[r]) for r in "tlb"}) == 3  # each adapter really applied
    # load / unload at run time; an id names one adapter for the engine's life
    assert calls["load_lora_adapter"]("extra", 50, str(setup.dirs["lm2"]))["lora_id"] == 50
    assert calls["unload_lora_adapter"]("extra") is True
    with pytest.raises(LoRAIdReusedError, match="used before"):
        calls["load_lora_adapter"]("extra", 50, str(setup.dirs["lm2"]))
    assert "extra" not in {e["name"] for e in calls["list_lora_adapters"]()}
