"""Model adapters: one per model family, chosen from the checkpoint's ``model_type``.

Invariants:
- Every adapter implements :class:`ModelAdapter`; the runner never touches a
  family-specific attribute of the Hugging Face model.
- :func:`load_adapter` passes ``revision`` to every ``from_pretrained`` it makes (config and
  model), so the family is chosen from the same revision that is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mmis.engine.model.adapter import ModelAdapter, ModelInputError, UnsupportedModelError
from mmis.engine.model.llava import LlavaAdapter
from mmis.engine.model.qwen2_vl import Qwen2VLAdapter

ADAPTERS: tuple[type[ModelAdapter], ...] = (LlavaAdapter, Qwen2VLAdapter)


def adapter_class(model_type: str) -> type[ModelAdapter]:
    for cls in ADAPTERS:
        if model_type in cls.model_types:
            return cls
    known = sorted(t for cls in ADAPTERS for t in cls.model_types)
    raise UnsupportedModelError(f"model_type {model_type!r} is not supported; known: {known}")


def _model_type(path_or_id: str | Path, revision: str | None = None) -> str:
    local = Path(path_or_id) / "config.json"
    if local.is_file():  # a local directory has no revisions
        return str(json.loads(local.read_text()).get("model_type", ""))
    from transformers import AutoConfig

    return str(AutoConfig.from_pretrained(str(path_or_id), revision=revision).model_type)


def load_adapter(
    path_or_id: str | Path,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    *,
    revision: str | None = None,
) -> ModelAdapter:
    """Load a checkpoint (at a hub ``revision``: branch, tag or commit) with the adapter of
    its family (CUDA when available, else CPU)."""
    family = adapter_class(_model_type(path_or_id, revision))
    return family.load(path_or_id, device, dtype, revision=revision)


__all__ = [
    "ADAPTERS",
    "LlavaAdapter",
    "ModelAdapter",
    "ModelInputError",
    "Qwen2VLAdapter",
    "UnsupportedModelError",
    "adapter_class",
    "load_adapter",
]
