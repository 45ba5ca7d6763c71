"""LLaVA family: a CLIP or SigLIP vision tower + MLP projector + a Llama-style language model.

Invariants:
- An item's tensors are ``{"pixel_values": [1, 3, H, W]}`` (a ``[3, H, W]`` array is accepted).
- Placeholder count = (H // patch) * (W // patch), plus 1 for the tower's CLS token when it
  has one (CLIP; SigLIP has none) and the feature strategy is ``"full"`` (``"default"``
  drops the first row); it always equals the rows ``encode_images`` returns for the item.
- Positions are plain 1-D: position p is p.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mmis.engine.execution.model.adapter import ModelAdapter, ModelInputError, as_tensor


class LlavaAdapter(ModelAdapter):
    family = "llava"
    model_types = ("llava",)

    def _pixels(self, item: Mapping[str, Any]) -> torch.Tensor:
        pixels = as_tensor(item.get("pixel_values"), "pixel_values")
        if pixels.ndim == 3:
            pixels = pixels.unsqueeze(0)
        if pixels.ndim != 4 or pixels.shape[0] != 1 or pixels.shape[1] != 3:
            raise ModelInputError(
                f"LLaVA pixel_values must be [1, 3, H, W] per item, got {tuple(pixels.shape)}"
            )
        if not pixels.is_floating_point():
            raise ModelInputError(f"LLaVA pixel_values must be floating point, got {pixels.dtype}")
        return pixels

    def num_placeholder_tokens(self, item: Mapping[str, Any]) -> int:
        pixels = self._pixels(item)
        patch = int(self.model.config.vision_config.patch_size)
        count = (int(pixels.shape[-2]) // patch) * (int(pixels.shape[-1]) // patch)
        if self._has_cls:
            count += 1
        if self.model.config.vision_feature_select_strategy == "default":
            count -= 1  # transformers drops the first row, CLS or not
        return count

    @property
    def _has_cls(self) -> bool:
        """Whether the tower prepends a class token (CLIP does; SigLIP does not)."""
        tower = self.model.model.vision_tower
        embeddings = getattr(getattr(tower, "vision_model", tower), "embeddings", None)
        return getattr(embeddings, "class_embedding", None) is not None

    def encode_images(self, items: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
        if not items:
            return []
        pixels = torch.cat([self._pixels(item) for item in items]).to(self.device, self.dtype)
        expected = int(self.model.config.vision_config.image_size)
        if pixels.shape[-1] != expected or pixels.shape[-2] != expected:
            raise ModelInputError(
                f"LLaVA expects {expected}x{expected} pixel_values, got "
                f"{pixels.shape[-2]}x{pixels.shape[-1]}"
            )
        out = self.model.model.get_image_features(pixel_values=pixels, return_dict=True)
        return [features.to(self.dtype) for features in out.pooler_output]
