"""Gemma 3 family: SigLIP tower + average-pooled projector + the Gemma 3 language model.

Invariants:
- An item's tensors are ``{"pixel_values": [1, 3, S, S]}`` (a ``[3, S, S]`` array is
  accepted), ``S`` the tower's ``image_size``: the processor resizes every image to it, so
  every image has ``mm_tokens_per_image`` placeholder (soft) tokens. Pan-and-scan crops are
  separate placeholder runs and are refused by P0 (``frontend/client/processor.py``).
- One image's soft tokens attend to each other in both directions, as transformers' Gemma 3
  mask does from ``token_type_ids`` (``bidirectional_images``): the runner passes each item's
  range as a span to the attention metadata and the scheduler never ends a chunk inside one
  (``whole_mm_spans``, ``engine/scheduling/scheduler.py``).
- Sliding-window layers pass their window to the paged kernel (``sliding_windows``); a window
  bounds a span too (``attn_metadata.py``).
- Positions are plain 1-D. Token embeddings are the model's own scaled embeddings; the image
  rows replace them unscaled, as ``Gemma3Model.forward`` does. ``final_logit_softcapping``
  applies to the logits when the checkpoint sets it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mmis.engine.execution.model.adapter import ModelAdapter, ModelInputError, as_tensor


class Gemma3Adapter(ModelAdapter):
    family = "gemma3"
    model_types = ("gemma3",)
    bidirectional_images = True
    sliding_windows = True

    @property
    def _image_size(self) -> int:
        return int(self.model.config.vision_config.image_size)

    def _pixels(self, item: Mapping[str, Any]) -> torch.Tensor:
        pixels = as_tensor(item.get("pixel_values"), "pixel_values")
        if pixels.ndim == 3:
            pixels = pixels.unsqueeze(0)
        size = self._image_size
        if pixels.ndim != 4 or pixels.shape[0] != 1 or tuple(pixels.shape[1:]) != (3, size, size):
            raise ModelInputError(
                f"Gemma 3 pixel_values must be [1, 3, {size}, {size}] per item, got "
                f"{tuple(pixels.shape)}"
            )
        if not pixels.is_floating_point():
            raise ModelInputError(
                f"Gemma 3 pixel_values must be floating point, got {pixels.dtype}"
            )
        return pixels

    def num_placeholder_tokens(self, item: Mapping[str, Any]) -> int:
        self._pixels(item)
        return int(self.model.config.mm_tokens_per_image)

    def encode_images(self, items: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
        if not items:
            return []
        pixels = torch.cat([self._pixels(item) for item in items]).to(self.device, self.dtype)
        out = self.model.model.get_image_features(pixel_values=pixels)
        return [features.to(self.dtype) for features in out.pooler_output]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = getattr(self.text_config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
