"""LLaVA-NeXT and LLaVA-OneVision: any-resolution tiles in front of a Llama/Qwen2-style model.

An image is a base tile (the whole image resized) plus the tiles of the grid picked from the
checkpoint's ``image_grid_pinpoints``; transformers packs their features itself (unpadding to
the image's aspect ratio, one ``image_newline`` row per feature row, OneVision's
``anyres_max_N`` shrinking), and this adapter calls exactly that code.

Invariants:
- An item's tensors are ``pixel_values`` ``[1, T, 3, S, S]`` (``[T, 3, S, S]`` accepted; S the
  tower's image size), ``image_sizes`` ``[1, 2]`` (the original height, width) and, for
  OneVision, ``batch_num_images`` ``[1]``: how many images the item's prompt had when it was
  processed (1: tiled; more: one square-padded tile, OneVision's multi-image mode). T must be
  at least the tile count the model derives from ``image_sizes`` (T beyond it is the
  processor's batch padding and is dropped, as transformers drops it).
- ``encode_images`` runs the model's own ``get_image_features`` (tower, projector and
  ``pack_image_features``), so each item's rows are exactly those transformers' forward
  scatters into its placeholders.
- ``num_placeholder_tokens`` runs the model's own ``pack_image_features`` on zero features of
  width 1 (shapes only, no tower): it always equals the rows ``encode_images`` returns, and the
  count the processor expands the image marker to.
- Positions are plain 1-D: position p is p.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from mmis.engine.execution.model.adapter import ModelAdapter, ModelInputError, as_tensor


@dataclasses.dataclass(frozen=True)
class _Item:
    pixels: torch.Tensor  # [tiles, 3, S, S], the tiles the model uses
    size: tuple[int, int]  # original (height, width)
    tiled: bool  # False: OneVision's multi-image mode (one tile)


class LlavaNextAdapter(ModelAdapter):
    family = "llava_next"
    model_types = ("llava_next",)
    _multi_image_mode = False  # OneVision: items carry batch_num_images

    # -- item tensors ----------------------------------------------------------------------
    @property
    def _tile(self) -> int:
        return int(self.model.config.vision_config.image_size)

    @property
    def _features_per_tile(self) -> int:
        return (self._tile // int(self.model.config.vision_config.patch_size)) ** 2

    def _tiled(self, item: Mapping[str, Any]) -> bool:
        return True  # LLaVA-NeXT always tiles

    def _num_tiles(self, size: tuple[int, int], tiled: bool) -> int:
        if not tiled:
            return 1
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        return int(
            image_size_to_num_patches(
                list(size), self.model.config.image_grid_pinpoints, self._tile
            )
        )

    def _item(self, item: Mapping[str, Any]) -> _Item:
        name = type(self).__name__.removesuffix("Adapter")
        sizes = as_tensor(item.get("image_sizes"), "image_sizes").reshape(-1)
        if sizes.numel() != 2 or sizes.is_floating_point() or bool((sizes <= 0).any()):
            raise ModelInputError(
                f"{name} image_sizes must be one positive (height, width) pair per item, got "
                f"{sizes.tolist()}"
            )
        size = (int(sizes[0]), int(sizes[1]))
        pixels = as_tensor(item.get("pixel_values"), "pixel_values")
        if pixels.ndim == 5 and pixels.shape[0] == 1:
            pixels = pixels[0]
        tile = self._tile
        if pixels.ndim != 4 or tuple(pixels.shape[1:]) != (3, tile, tile):
            raise ModelInputError(
                f"{name} pixel_values must be [1, tiles, 3, {tile}, {tile}] per item, got "
                f"{tuple(as_tensor(item.get('pixel_values'), 'pixel_values').shape)}"
            )
        if not pixels.is_floating_point():
            raise ModelInputError(f"{name} pixel_values must be floating point, got {pixels.dtype}")
        tiled = self._tiled(item)
        tiles = self._num_tiles(size, tiled)
        if pixels.shape[0] < tiles:
            raise ModelInputError(
                f"{name} image of size {size[0]}x{size[1]} needs {tiles} tiles, pixel_values "
                f"has {pixels.shape[0]}"
            )
        return _Item(pixels[:tiles], size, tiled)

    # -- the pieces ------------------------------------------------------------------------
    def _pack(self, features: list[torch.Tensor], sizes: torch.Tensor) -> list[torch.Tensor]:
        packed, _ = self.model.model.pack_image_features(
            features,
            sizes,
            vision_feature_select_strategy=self.model.config.vision_feature_select_strategy,
            image_newline=torch.zeros(1),
        )
        return list(packed)

    def num_placeholder_tokens(self, item: Mapping[str, Any]) -> int:
        parsed = self._item(item)
        zeros = torch.zeros(parsed.pixels.shape[0], self._features_per_tile, 1)
        (packed,) = self._pack([zeros], torch.tensor([parsed.size]))
        return int(packed.shape[0])

    def _encode(self, items: Sequence[_Item]) -> list[torch.Tensor]:
        pixels = torch.cat([it.pixels for it in items]).to(self.device, self.dtype)
        sizes = torch.tensor([it.size for it in items], device=self.device)
        out = self.model.model.get_image_features(
            pixel_values=pixels, image_sizes=sizes, return_dict=True
        )
        return [features.to(self.dtype) for features in out.pooler_output]

    def encode_images(self, items: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
        if not items:
            return []
        return self._encode([self._item(item) for item in items])

    # -- the processor's output --------------------------------------------------------------
    def _images_per_prompt(self, batch: Mapping[str, Any], count: int) -> list[int]:
        return [1] * count

    def split_processor_output(self, batch: Mapping[str, Any]) -> list[dict[str, Any]]:
        pixels = batch.get("pixel_values")
        if pixels is None or len(pixels) == 0:
            return []
        sizes = batch.get("image_sizes")
        if sizes is None or len(sizes) != len(pixels):
            raise ModelInputError(
                f"{len(pixels)} images' pixel_values need as many image_sizes, got "
                f"{None if sizes is None else len(sizes)}"
            )
        per_prompt = self._images_per_prompt(batch, len(pixels))
        items: list[dict[str, Any]] = []
        for i in range(len(pixels)):
            size = (int(sizes[i][0]), int(sizes[i][1]))
            tiles = self._num_tiles(size, per_prompt[i] == 1)
            item: dict[str, Any] = {
                "pixel_values": pixels[i : i + 1, :tiles],
                "image_sizes": sizes[i : i + 1],
            }
            if self._multi_image_mode:
                item["batch_num_images"] = np.asarray([per_prompt[i]], dtype=np.int64)
            items.append(item)
        return items


class LlavaOnevisionAdapter(LlavaNextAdapter):
    """OneVision: as LLaVA-NeXT, plus the ``anyres_max_N`` cap and multi-image prompts."""

    family = "llava_onevision"
    model_types = ("llava_onevision",)
    _multi_image_mode = True

    def _tiled(self, item: Mapping[str, Any]) -> bool:
        found = item.get("batch_num_images")
        if found is None:
            return True  # as transformers: one image per prompt
        count = as_tensor(found, "batch_num_images").reshape(-1)
        if count.numel() != 1 or count.is_floating_point() or int(count[0]) < 1:
            raise ModelInputError(
                f"LlavaOnevision batch_num_images must be one positive count per item, got "
                f"{count.tolist()}"
            )
        return int(count[0]) == 1

    def _pack(self, features: list[torch.Tensor], sizes: torch.Tensor) -> list[torch.Tensor]:
        packed, _ = self.model.model.pack_image_features(
            features,
            sizes,
            image_newline=torch.zeros(1),
            vision_aspect_ratio=self.model.config.vision_aspect_ratio,
        )
        return list(packed)

    def encode_images(self, items: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
        if not items:
            return []
        parsed = [self._item(item) for item in items]
        out: list[torch.Tensor | None] = [None] * len(parsed)
        tiled = [i for i, it in enumerate(parsed) if it.tiled]
        if tiled:
            for i, features in zip(tiled, self._encode([parsed[i] for i in tiled]), strict=True):
                out[i] = features
        single = [i for i, it in enumerate(parsed) if not it.tiled]
        if single:
            # transformers knows this mode only from a prompt of several images: a lone one is
            # encoded with a copy of itself (the tower runs per tile, so the rows are the same)
            group = [parsed[i] for i in single] + ([parsed[single[0]]] if len(single) == 1 else [])
            pixels = torch.cat([it.pixels for it in group]).to(self.device, self.dtype)
            sizes = torch.tensor([it.size for it in group], device=self.device)
            features = self.model.model.get_image_features(
                pixel_values=pixels,
                image_sizes=sizes,
                batch_num_images=torch.tensor([len(group)]),
                return_dict=True,
            ).pooler_output
            for i, rows in zip(single, features, strict=False):
                out[i] = rows
        return [rows.to(self.dtype) for rows in out if rows is not None]

    def _images_per_prompt(self, batch: Mapping[str, Any], count: int) -> list[int]:
        found = batch.get("batch_num_images")
        if found is None:
            return [1] * count
        per_prompt = [int(n) for n in np.asarray(found).reshape(-1)]
        expanded = [n for n in per_prompt for _ in range(n)]
        if len(expanded) != count:
            raise ModelInputError(
                f"batch_num_images {per_prompt} does not add up to the {count} images"
            )
        return expanded
