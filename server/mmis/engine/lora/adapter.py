"""Reading a PEFT LoRA directory (``adapter_config.json`` + ``adapter_model.safetensors``).

mmis reads PEFT's format itself (peft is only the tests' reference): the config's ``r``,
``lora_alpha``, ``use_rslora`` and ``target_modules``, and one ``lora_A`` / ``lora_B`` pair per
target module, keyed ``base_model.model.<module name>.lora_{A,B}.weight`` where ``<module
name>`` is the module's name in the transformers model the engine runs.

Invariants:
- :func:`load_adapter` validates everything before returning: both files present and readable,
  the config a plain LoRA (no DoRA, bias, ``modules_to_save``, per-module rank/alpha patterns,
  ``fan_in_fan_out``), rank <= ``max_rank``, every weight pair's module among ``modules`` (the
  engine's LoRA-capable projections) with ``A`` ``[r, in]`` and ``B`` ``[out, r]`` matching it,
  every ``target_modules`` name matching at least one module. A refusal is a typed
  :class:`~mmis.engine.lora.errors.LoRAError` naming the cause.
- The scaling is folded into ``B`` here: ``alpha / r``, or ``alpha / sqrt(r)`` with rslora
  (PEFT's rule), so the device computes ``x A^T (s B)^T`` and keeps no per-module scale.
- Weights stay on the host in float32 (the resident set's CPU copy); the layer casts on load.
- A ``path`` of the form ``hf://<org>/<name>[@<revision>]`` (a hub id, checked by P0:
  ``frontend/client/lora_hub.py``) is read from the local HF cache only (:func:`local_directory`):
  P0 downloaded its files there first, on its own thread; the engine never touches the network,
  so a hub adapter dropped from the host set reads back from the same snapshot. Not in the
  cache is a :class:`~mmis.engine.lora.errors.LoRAFileError` naming the id.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from mmis.engine.lora.errors import (
    LoRAConfigError,
    LoRAFileError,
    LoRARankError,
    LoRATargetError,
)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
HUB_SCHEME = "hf://"
KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter on the host: ``weights[module] = (A [r, in], scaled B [out, r])``."""

    name: str
    lora_id: int
    rank: int
    scaling: float
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    def modules(self) -> frozenset[str]:
        return frozenset(self.weights)

    def touches(self, prefixes: tuple[str, ...]) -> bool:
        """Whether any of its modules lies under one of ``prefixes`` (e.g. the vision tower)."""
        return any(m == p or m.startswith(p + ".") for m in self.weights for p in prefixes)

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _read_config(name: str, path: str) -> dict[str, object]:
    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoRAFileError(f"LoRA adapter {name!r}: {file} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAFileError(f"LoRA adapter {name!r}: cannot read {file}: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAFileError(f"LoRA adapter {name!r}: {file} is not a JSON object")
    return config


def _check_config(name: str, config: dict[str, object]) -> tuple[int, float, bool, object]:
    def refuse(why: str) -> LoRAConfigError:
        return LoRAConfigError(f"LoRA adapter {name!r}: {why}")

    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise refuse(f"peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        raise refuse("DoRA (use_dora) is not supported")
    if config.get("bias", "none") != "none":
        raise refuse(f"bias {config.get('bias')!r} is not supported (only 'none')")
    if config.get("modules_to_save"):
        raise refuse("modules_to_save is not supported (full copies of modules)")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise refuse("per-module rank_pattern / alpha_pattern is not supported")
    if config.get("fan_in_fan_out"):
        raise refuse("fan_in_fan_out (Conv1D layers) is not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise refuse(f"r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise refuse(f"lora_alpha must be a number, got {alpha!r}")
    return rank, float(alpha), bool(config.get("use_rslora", False)), config.get("target_modules")


def _read_weights(name: str, path: str) -> dict[str, torch.Tensor]:
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.exists(file):
        raise LoRAFileError(f"LoRA adapter {name!r}: {file} does not exist")
    try:  # safetensors reports an unreadable file as "No such file or directory"
        open(file, "rb").close()
    except PermissionError:
        raise LoRAFileError(
            f"LoRA adapter {name!r}: {file} is not readable by this process (uid "
            f"{os.getuid()}): make the adapter's files readable to it (e.g. chmod a+r)"
        ) from None
    except OSError as exc:
        raise LoRAFileError(f"LoRA adapter {name!r}: cannot read {file}: {exc}") from None
    try:
        from safetensors.torch import load_file

        return load_file(file, device="cpu")
    except Exception as exc:  # safetensors raises its own SafetensorError, OSError, ...
        raise LoRAFileError(f"LoRA adapter {name!r}: cannot read {file}: {exc}") from None


def _target_matches(target: object, modules: Mapping[str, tuple[int, int]]) -> list[str]:
    """The ``target_modules`` entries that match no module (PEFT's rules: a string is a full
    regex over the module name, a list names modules by their last name components)."""
    if target is None or target == "all-linear":
        return []
    if isinstance(target, str):
        return [] if any(re.fullmatch(target, m) for m in modules) else [target]
    if isinstance(target, list):
        missing = []
        for t in target:
            if not any(m == t or m.endswith("." + str(t)) for m in modules):
                missing.append(str(t))
        return missing
    return [repr(target)]


def local_directory(name: str, path: str) -> str:
    """The directory of adapter ``path``: itself, or for a hub id the snapshot of its
    revision in the local HF cache (``HF_HOME`` / ``HF_HUB_CACHE``; never the network)."""
    if not path.startswith(HUB_SCHEME):
        return path
    repo, _, revision = path.removeprefix(HUB_SCHEME).partition("@")
    try:
        from huggingface_hub import snapshot_download

        folder: str = snapshot_download(
            repo,
            revision=revision or None,
            allow_patterns=[CONFIG_FILE, "adapter_model.*"],
            local_files_only=True,
        )
    except Exception as exc:  # LocalEntryNotFoundError, a malformed id, ...
        raise LoRAFileError(
            f"LoRA adapter {name!r}: {path} is not in the engine's HF cache (P0 downloads hub "
            f"adapters into the HF_HOME it shares with the engine): {type(exc).__name__}"
        ) from None
    return folder


def load_adapter(
    name: str,
    lora_id: int,
    path: str,
    modules: Mapping[str, tuple[int, int]],
    max_rank: int,
) -> LoRAAdapter:
    """The adapter at ``path``, checked against ``modules`` (name -> ``(in, out)`` of every
    LoRA-capable projection of the engine's model) and ``max_rank`` (see the docstring)."""
    path = local_directory(name, path)
    if not os.path.isdir(path):
        raise LoRAFileError(f"LoRA adapter {name!r}: {path} is not a directory")
    rank, alpha, rslora, target = _check_config(name, _read_config(name, path))
    if rank > max_rank:
        raise LoRARankError(
            f"LoRA adapter {name!r}: rank {rank} exceeds --max-lora-rank {max_rank}"
        )
    missing = _target_matches(target, modules)
    if missing:
        raise LoRATargetError(
            f"LoRA adapter {name!r}: target modules {missing} match no projection of the model"
        )
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_weights(name, path).items():
        match = KEY.match(key)
        if match is None:
            raise LoRAConfigError(f"LoRA adapter {name!r}: unexpected tensor {key!r}")
        parts.setdefault(match["module"], {})[match["which"]] = tensor
    if not parts:
        raise LoRAFileError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in sorted(parts.items()):
        if module not in modules:
            raise LoRATargetError(
                f"LoRA adapter {name!r}: the model has no LoRA-capable projection {module!r}"
            )
        if set(pair) != {"A", "B"}:
            raise LoRAFileError(f"LoRA adapter {name!r}: {module} lacks lora_A or lora_B")
        a, b = pair["A"], pair["B"]
        in_f, out_f = modules[module]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != in_f or b.shape[0] != out_f:
            raise LoRATargetError(
                f"LoRA adapter {name!r}: {module} is {in_f}->{out_f} in the model, the adapter's "
                f"A is {tuple(a.shape)} and B {tuple(b.shape)}"
            )
        if a.shape[0] != b.shape[1] or a.shape[0] > max_rank:
            raise LoRARankError(
                f"LoRA adapter {name!r}: {module} has rank {a.shape[0]} (B: {b.shape[1]}); "
                f"--max-lora-rank is {max_rank}"
            )
        weights[module] = (a.float().contiguous(), (b.float() * scaling).contiguous())
    return LoRAAdapter(name, lora_id, rank, scaling, weights)
