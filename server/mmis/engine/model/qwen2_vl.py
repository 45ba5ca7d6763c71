"""Qwen2-VL family: a ViT with patch merging + a Qwen2 language model with M-RoPE.

Also Qwen2.5-VL: its vision tower (windowed attention, SwiGLU) sits behind the same
``get_image_features`` and its language model and image positions are Qwen2-VL's.

Invariants:
- An item's tensors are ``{"pixel_values": [t*h*w, C*tp*p*p], "image_grid_thw": [1, 3]}``.
- Placeholder count = t*h*w // merge**2 == rows ``encode_images`` returns for the item.
- M-RoPE positions (``[3, n]``: temporal, height, width) follow the model's own rule: text
  tokens advance all three by one; an image's tokens sit on a grid starting at the current
  position, after which the position advances by max(h, w) // merge. Decode positions continue
  the text rule. They are a pure function of (start, n, item layout), so chunked prefill,
  prefix hits and decode agree with a whole-prompt computation.
- A chunk past all of its items (every decode row) is the 1-D positions of the step's
  metadata plus one per-request shift (sum of max(h, w) // merge - placeholder length over its
  items), vectorised; only chunks that overlap an item take the per-token rule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from mmis.engine.attn_metadata import AttentionMetadata
from mmis.engine.model.adapter import ModelAdapter, ModelInputError, as_tensor
from mmis.engine.sched_output import MultiModalInput, ScheduledRequest


class Qwen2VLAdapter(ModelAdapter):
    family = "qwen2-vl"
    model_types = ("qwen2_vl", "qwen2_5_vl")  # same language model, positions and interface

    @property
    def merge_size(self) -> int:
        return int(self.model.config.vision_config.spatial_merge_size)

    def _grid(self, item: Mapping[str, Any]) -> tuple[int, int, int]:
        grid = as_tensor(item.get("image_grid_thw"), "image_grid_thw").reshape(-1)
        if grid.numel() != 3 or bool((grid <= 0).any()):
            raise ModelInputError(f"image_grid_thw must be one positive (t, h, w), got {grid}")
        t, h, w = (int(v) for v in grid.tolist())
        if h % self.merge_size or w % self.merge_size:
            raise ModelInputError(f"grid {(t, h, w)} is not divisible by merge {self.merge_size}")
        return t, h, w

    def _item_grid(self, item: MultiModalInput) -> tuple[int, int, int]:
        if item.grid_thw is not None:
            return item.grid_thw
        if item.data is not None and "image_grid_thw" in item.data:
            return self._grid(item.data)
        raise ModelInputError(f"item {item.mm_hash} has no grid_thw (needed for M-RoPE)")

    def num_placeholder_tokens(self, item: Mapping[str, Any]) -> int:
        t, h, w = self._grid(item)
        return t * h * w // self.merge_size**2

    def encode_images(self, items: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
        if not items:
            return []
        pixels, grids = [], []
        for item in items:
            t, h, w = self._grid(item)
            rows = as_tensor(item.get("pixel_values"), "pixel_values")
            if rows.ndim != 2 or rows.shape[0] != t * h * w:
                raise ModelInputError(
                    f"pixel_values must be [{t * h * w}, features] for grid {(t, h, w)}, "
                    f"got {tuple(rows.shape)}"
                )
            pixels.append(rows)
            grids.append((t, h, w))
        grid = torch.tensor(grids, dtype=torch.long, device=self.device)
        values = torch.cat(pixels).to(self.device, self.dtype)
        out = self.model.model.get_image_features(values, image_grid_thw=grid, return_dict=True)
        return [features.to(self.dtype) for features in out.pooler_output]

    def positions(
        self, start: int, num_tokens: int, items: Sequence[MultiModalInput]
    ) -> torch.Tensor:
        end = start + num_tokens
        out = torch.empty(3, num_tokens, dtype=torch.long)
        cursor, index = 0, 0  # next text position, prompt index reached
        for item in sorted(items, key=lambda i: i.offset):
            if item.offset >= end:
                break
            if item.offset < index:
                raise ModelInputError(f"item {item.mm_hash} overlaps the previous item")
            self._fill_text(out, start, end, index, item.offset, cursor)
            cursor += item.offset - index
            t, h, w = self._item_grid(item)
            gh, gw = h // self.merge_size, w // self.merge_size
            if t * gh * gw != item.length:
                raise ModelInputError(
                    f"item {item.mm_hash}: grid {(t, h, w)} gives {t * gh * gw} tokens, "
                    f"placeholder has {item.length}"
                )
            lo, hi = max(item.offset, start), min(item.end, end)
            if lo < hi:
                k = torch.arange(lo - item.offset, hi - item.offset)
                out[0, lo - start : hi - start] = cursor + k // (gh * gw)
                out[1, lo - start : hi - start] = cursor + (k // gw) % gh
                out[2, lo - start : hi - start] = cursor + k % gw
            cursor += max(gh, gw)
            index = item.end
        self._fill_text(out, start, end, index, max(index, end), cursor)
        return out

    def step_positions(
        self, seqs: Sequence[ScheduledRequest], meta: AttentionMetadata
    ) -> torch.Tensor:
        shifts = np.zeros(len(seqs), dtype=np.int64)
        overlapping = []
        for i, s in enumerate(seqs):
            start, end = s.start_position, s.end_position
            items = sorted((it for it in s.mm_items if it.offset < end), key=lambda it: it.offset)
            if any(it.end > start for it in items):
                overlapping.append(i)
                continue
            index = 0
            for item in items:
                if item.offset < index:
                    raise ModelInputError(f"item {item.mm_hash} overlaps the previous item")
                shifts[i] += self._advance(item) - item.length
                index = item.end
        shift = torch.from_numpy(np.repeat(shifts, meta.query_lens_host)).to(self.device)
        out = (meta.positions + shift).unsqueeze(0).repeat(3, 1)
        offsets = np.concatenate([[0], np.cumsum(meta.query_lens_host)])
        for i in overlapping:
            s = seqs[i]
            rows = self.positions(s.start_position, s.num_tokens, s.mm_items)
            out[:, int(offsets[i]) : int(offsets[i + 1])] = rows.to(self.device)
        return out.unsqueeze(1)  # [3, 1, N]

    def _advance(self, item: MultiModalInput) -> int:
        """How far an item moves the text position (validating its grid)."""
        t, h, w = self._item_grid(item)
        gh, gw = h // self.merge_size, w // self.merge_size
        if t * gh * gw != item.length:
            raise ModelInputError(
                f"item {item.mm_hash}: grid {(t, h, w)} gives {t * gh * gw} tokens, "
                f"placeholder has {item.length}"
            )
        return max(gh, gw)

    @staticmethod
    def _fill_text(out: torch.Tensor, start: int, end: int, a: int, b: int, base: int) -> None:
        lo, hi = max(a, start), min(b, end)
        if lo < hi:
            out[:, lo - start : hi - start] = torch.arange(lo, hi) - a + base

    def split_processor_output(self, batch: Mapping[str, Any]) -> list[dict[str, Any]]:
        grids = batch.get("image_grid_thw")
        if grids is None:
            return []
        pixels = batch["pixel_values"]
        items, row = [], 0
        for i in range(len(grids)):
            count = int(as_tensor(grids[i], "image_grid_thw").prod())
            items.append(
                {"pixel_values": pixels[row : row + count], "image_grid_thw": grids[i : i + 1]}
            )
            row += count
        return items
