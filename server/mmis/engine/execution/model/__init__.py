"""Model adapters: one per model family, chosen from the checkpoint's ``model_type``.

Invariants:
- Every adapter implements :class:`ModelAdapter`; the runner never touches a
  family-specific attribute of the Hugging Face model.
- :data:`ADAPTERS` maps each supported ``model_type`` to its adapter's module and class, imported
  only when that family is loaded (an adapter's module may import family-specific code).
- :func:`load_adapter` passes ``revision`` to every ``from_pretrained`` it makes (config and
  model), so the family is chosen from the same revision that is loaded.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch

from mmis.engine.execution.model.adapter import ModelAdapter, ModelInputError, UnsupportedModelError
from mmis.engine.execution.model.llava import LlavaAdapter
from mmis.engine.execution.model.qwen2_vl import Qwen2VLAdapter

# model_type -> (module, class) of its adapter, in mmis/engine/execution/model/
ADAPTERS: dict[str, tuple[str, str]] = {
    "llava": ("mmis.engine.execution.model.llava", "LlavaAdapter"),
    "qwen2_vl": ("mmis.engine.execution.model.qwen2_vl", "Qwen2VLAdapter"),
    "qwen2_5_vl": ("mmis.engine.execution.model.qwen2_vl", "Qwen2VLAdapter"),
    "llava_next": ("mmis.engine.execution.model.llava_next", "LlavaNextAdapter"),
    "llava_onevision": ("mmis.engine.execution.model.llava_next", "LlavaOnevisionAdapter"),
    "gemma3": ("mmis.engine.execution.model.gemma3", "Gemma3Adapter"),
}


def adapter_class(model_type: str) -> type[ModelAdapter]:
    found = ADAPTERS.get(model_type)
    if found is None:
        known = sorted(ADAPTERS)
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported; known: {known}")
    cls: type[ModelAdapter] = getattr(importlib.import_module(found[0]), found[1])
    if model_type not in cls.model_types:  # the table and the class must agree
        raise UnsupportedModelError(f"{found[1]} does not declare model_type {model_type!r}")
    return cls


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
    fuse: bool = True,
) -> ModelAdapter:
    """Load a checkpoint (at a hub ``revision``: branch, tag or commit) with the adapter of
    its family (CUDA when available, else CPU); ``fuse``: :meth:`ModelAdapter.load`'s."""
    family = adapter_class(_model_type(path_or_id, revision))
    return family.load(path_or_id, device, dtype, revision=revision, fuse=fuse)


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
