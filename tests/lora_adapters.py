"""PEFT LoRA adapters of random non-zero weights for the tiny models (issue 47's tests), and
broken copies of them for the refusal cases.

- :func:`make_adapter` saves a real PEFT adapter (``LoraConfig`` + ``get_peft_model`` +
  ``save_pretrained``) whose A and B are seeded random (PEFT inits B to zero, which would make
  every adapter equal the base), targeting :data:`LM` (the language model's projections) or
  :data:`TOWER` (a few of them plus the vision tower and projector).
- :func:`broken_copies` writes, beside a good adapter, one adapter per refusal the engine
  names: a rank over the limit, target modules the model lacks, corrupt weights, no weights
  file (each a copy whose one file is changed).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

LM = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
TOWER = {  # language model + vision tower + projector
    "llava": r".*(language_model.*\.(q_proj|v_proj|down_proj)|vision_tower.*\.(q_proj|fc1|out_proj)"
    r"|multi_modal_projector\.linear_[12])",
    "qwen2-vl": r".*(language_model.*\.(q_proj|v_proj|down_proj)|visual\.blocks.*\.(qkv|fc2)"
    r"|visual\.merger\.mlp\.[02])",
}
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def make_adapter(
    model_dir: Path,
    out: Path,
    target: str,
    *,
    rank: int,
    alpha: int,
    seed: int,
    rslora: bool = False,
) -> Path:
    """Save a PEFT LoRA adapter of ``model_dir`` at ``out`` (its A and B seeded random)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=target)
    peft_model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # PEFT inits B to zero: random non-zero A and B
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    peft_model.save_pretrained(out)
    return out


def broken_copies(good: Path, root: Path, max_rank: int) -> dict[str, Path]:
    """Copies of adapter ``good`` under ``root``, each broken one way: ``rank`` (its config's
    ``r`` above ``max_rank``), ``target`` (a module the model lacks), ``corrupt`` (weights that
    are not safetensors), ``missing`` (no weights file)."""
    out: dict[str, Path] = {}
    for case in ("rank", "target", "corrupt", "missing"):
        path = root / f"broken-{case}"
        shutil.copytree(good, path)
        config = json.loads((path / CONFIG).read_text())
        if case == "rank":
            config["r"] = max_rank * 4
        elif case == "target":
            config["target_modules"] = ["no_such_proj"]
        elif case == "corrupt":
            (path / WEIGHTS).write_bytes(b"\x00not safetensors\xff" * 8)
        else:
            (path / WEIGHTS).unlink()
        (path / CONFIG).write_text(json.dumps(config))
        out[case] = path
    return out
