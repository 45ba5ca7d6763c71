"""Qwen2-VL family: a ViT with patch merging + a Qwen2 language model with M-RoPE.

Also Qwen2.5-VL: its vision tower (windowed attention, SwiGLU) sits behind the same
``get_image_features`` and its language model and image positions are Qwen2-VL's.

Invariants:
- An image item's tensors are ``{"pixel_values": [t*h*w, C*tp*p*p], "image_grid_thw": [1, 3]}``;
  a video item's are ``{"pixel_values_videos": [t*h*w, C*tp*p*p], "video_grid_thw": [1, 3]}``
  plus, for Qwen2.5-VL, ``second_per_grid_ts`` ``[1]`` (seconds per temporal patch). The
  tensors alone say which an item is (no protocol field); a video is encoded by the model's
  own ``get_video_features``, an image by ``get_image_features``.
- Placeholder count = t*h*w // merge**2 == rows ``encode_images`` returns for the item.
- M-RoPE positions (``[3, n]``: temporal, height, width) follow the model's own rule
  (``get_rope_index``): text tokens advance all three by one; an item's tokens sit on a grid
  starting at the current position, after which the position advances by max(h, w) // merge.
  The temporal index of temporal patch ``i`` is ``int(i * interval)``: ``interval`` is 1 for
  images and Qwen2-VL videos, ``tokens_per_second * second_per_grid_ts`` for Qwen2.5-VL videos.
  Decode positions continue the text rule. They are a pure function of (start, n, item
  layout), so chunked prefill, prefix hits and decode agree with a whole-prompt computation.
- A Qwen2.5-VL video's ``second_per_grid_ts`` is read once, when the request is made, into
  its :class:`MultiModalInput` (``second_per_grid``, kept when the tensors are dropped), so
  every chunk of the item has it; a video without it gets transformers' default, 1 s.
- A chunk past all of its items (every decode row) is its 1-D positions plus one per-request
  shift (sum of max(h, w) // merge - placeholder length over its items), vectorised; only
  chunks that overlap an item take the per-token rule. The step's positions are built on the
  host (:meth:`Qwen2VLAdapter.host_positions`) and travel in the step's one upload
  (``runner.py``): no upload or device op of their own before the forward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from mmis.engine.execution.attn_metadata import AttentionMetadata, to_device
from mmis.engine.execution.model.adapter import ModelAdapter, ModelInputError, as_tensor
from mmis.engine.scheduling.sched_output import MultiModalInput, ScheduledRequest


def is_video(item: Mapping[str, Any]) -> bool:
    """A video item (``video_grid_thw``) rather than an image (``image_grid_thw``)."""
    return "video_grid_thw" in item


class Qwen2VLAdapter(ModelAdapter):
    family = "qwen2-vl"
    model_types = ("qwen2_vl", "qwen2_5_vl")  # same language model, positions and interface

    def __init__(self, model: Any, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(model, device, dtype)
        vision = model.config.vision_config
        # Qwen2.5-VL spaces a video's temporal positions by tokens_per_second; Qwen2-VL not
        self.tokens_per_second: float | None = (
            float(vision.tokens_per_second)
            if model.config.model_type == "qwen2_5_vl"
            and getattr(vision, "tokens_per_second", None) is not None
            else None
        )

    @property
    def merge_size(self) -> int:
        return int(self.model.config.vision_config.spatial_merge_size)

    def _grid(self, item: Mapping[str, Any]) -> tuple[int, int, int]:
        key = "video_grid_thw" if is_video(item) else "image_grid_thw"
        grid = as_tensor(item.get(key), key).reshape(-1)
        if grid.numel() != 3 or bool((grid <= 0).any()):
            raise ModelInputError(f"{key} must be one positive (t, h, w), got {grid}")
        t, h, w = (int(v) for v in grid.tolist())
        if h % self.merge_size or w % self.merge_size:
            raise ModelInputError(f"grid {(t, h, w)} is not divisible by merge {self.merge_size}")
        return t, h, w

    def _item_grid(self, item: MultiModalInput) -> tuple[int, int, int]:
        if item.grid_thw is not None:
            return item.grid_thw
        if item.data is not None and ("image_grid_thw" in item.data or is_video(item.data)):
            return self._grid(item.data)
        raise ModelInputError(f"item {item.mm_hash} has no grid_thw (needed for M-RoPE)")

    def num_placeholder_tokens(self, item: Mapping[str, Any]) -> int:
        t, h, w = self._grid(item)
        return t * h * w // self.merge_size**2

    def encode_images(self, items: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
        """Images in one ``get_image_features`` call, videos in one ``get_video_features``
        call; the outputs come back in the items' order."""
        out: list[torch.Tensor | None] = [None] * len(items)
        for video in (False, True):
            chosen = [i for i, item in enumerate(items) if is_video(item) == video]
            if chosen:
                encoded = self._encode([items[i] for i in chosen], video)
                for i, features in zip(chosen, encoded, strict=True):
                    out[i] = features
        return [features for features in out if features is not None]

    def _encode(self, items: Sequence[Mapping[str, Any]], video: bool) -> list[torch.Tensor]:
        name = "pixel_values_videos" if video else "pixel_values"
        pixels, grids = [], []
        for item in items:
            t, h, w = self._grid(item)
            rows = as_tensor(item.get(name), name)
            if rows.ndim != 2 or rows.shape[0] != t * h * w:
                raise ModelInputError(
                    f"{name} must be [{t * h * w}, features] for grid {(t, h, w)}, "
                    f"got {tuple(rows.shape)}"
                )
            pixels.append(rows)
            grids.append((t, h, w))
        grid = torch.tensor(grids, dtype=torch.long, device=self.device)
        values = torch.cat(pixels).to(self.device, self.dtype)
        model = self.model.model
        if video:
            out = model.get_video_features(values, video_grid_thw=grid, return_dict=True)
        else:
            out = model.get_image_features(values, image_grid_thw=grid, return_dict=True)
        return [features.to(self.dtype) for features in out.pooler_output]

    def _interval(self, item: MultiModalInput) -> torch.Tensor | None:
        """The temporal spacing of an item's patches (float32, as the model computes it), or
        None for spacing 1 (Qwen2-VL; an image has one temporal patch: index 0 either way)."""
        if self.tokens_per_second is None:
            return None
        seconds = 1.0 if item.second_per_grid is None else item.second_per_grid
        spacing = torch.tensor(seconds, dtype=torch.float32)
        return self.tokens_per_second * spacing

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
            if lo < hi:  # only an item this chunk covers needs its temporal spacing
                k = torch.arange(lo - item.offset, hi - item.offset)
                frame = k // (gh * gw)
                interval = self._interval(item)
                if interval is not None:
                    frame = (frame * interval).long()
                out[0, lo - start : hi - start] = cursor + frame
                out[1, lo - start : hi - start] = cursor + (k // gw) % gh
                out[2, lo - start : hi - start] = cursor + k % gw
            cursor += max(gh, gw)
            index = item.end
        self._fill_text(out, start, end, index, max(index, end), cursor)
        return out

    def host_positions(self, seqs: Sequence[ScheduledRequest]) -> np.ndarray:
        """``[3, N]`` int64 on the host: a chunk past all of its items is ``start ..`` plus its
        request's shift (vectorised over the step); a chunk overlapping an item takes
        :meth:`positions`."""
        count = len(seqs)
        sizes = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=count)
        starts = np.fromiter((s.start_position for s in seqs), dtype=np.int64, count=count)
        shifts = np.zeros(count, dtype=np.int64)
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
        offsets = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        pos = np.arange(offsets[-1], dtype=np.int64) - np.repeat(
            offsets[:-1] - starts - shifts, sizes
        )
        out = np.repeat(pos[None, :], 3, axis=0)
        for i in overlapping:
            s = seqs[i]
            rows = self.positions(s.start_position, s.num_tokens, s.mm_items)
            out[:, offsets[i] : offsets[i + 1]] = rows.numpy()
        return out

    def step_positions(
        self, seqs: Sequence[ScheduledRequest], meta: AttentionMetadata
    ) -> torch.Tensor:
        """:meth:`host_positions` on the device (``[3, 1, N]``), pinned and non-blocking on
        CUDA (the runner sends them in the step's one upload instead)."""
        host = torch.from_numpy(self.host_positions(seqs))
        return to_device(host, self.device).unsqueeze(1)

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
        """Per-item tensors: the batch's images in order, then its videos in order."""
        items: list[dict[str, Any]] = []
        for pixel_key, grid_key in (
            ("pixel_values", "image_grid_thw"),
            ("pixel_values_videos", "video_grid_thw"),
        ):
            grids = batch.get(grid_key)
            if grids is None:
                continue
            pixels = batch[pixel_key]
            seconds = batch.get("second_per_grid_ts") if grid_key == "video_grid_thw" else None
            row = 0
            for i in range(len(grids)):
                count = int(as_tensor(grids[i], grid_key).prod())
                item = {pixel_key: pixels[row : row + count], grid_key: grids[i : i + 1]}
                if seconds is not None:
                    item["second_per_grid_ts"] = seconds[i : i + 1]
                items.append(item)
                row += count
        return items
