"""Test-side P0 stand-in for video: engine requests from text + clips (+ images), and the
transformers reference for them.

Invariants:
- A clip is ``[frames, height, width, 3]`` uint8 frames, already sampled, with the fps they
  were sampled at; the processor gets them with ``do_sample_frames=False`` and that fps as
  metadata (so Qwen2.5-VL's ``second_per_grid_ts`` is ``temporal_patch_size / fps``).
- The prompt puts the videos first, then the images, then the text; the processor runs once
  on the whole request, exactly as the reference ``generate()`` sees it, and each item's
  tensors are that output split per item (the adapter's own ``split_processor_output``
  layout: ``pixel_values_videos`` + ``video_grid_thw`` (+ ``second_per_grid_ts``)).
- An item's ``mm_hash`` is a digest of its modality and pixel tensors.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from engine_inputs import ModelKit, _runs, new_id
from PIL import Image

from mmis.protocol.messages import (
    EngineCoreRequest,
    MultiModalFeature,
    PlaceholderRange,
    SamplingParams,
)


@dataclasses.dataclass(frozen=True)
class Clip:
    frames: np.ndarray  # [T, H, W, 3] uint8
    fps: float = 2.0


def clip(seed: int, num_frames: int = 8, size: int = 64, fps: float = 2.0) -> Clip:
    """A short synthetic clip: a random first frame drifting a little frame by frame."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, (size, size, 3), dtype=np.int64)
    steps = rng.integers(-20, 20, (num_frames, 1, 1, 3))
    frames = np.clip(base[None] + np.cumsum(steps, axis=0), 0, 255).astype(np.uint8)
    return Clip(frames, fps)


def _inputs(kit: ModelKit, text: str, videos: Sequence[Clip], images: Sequence[Image.Image]) -> Any:
    from transformers.video_utils import VideoMetadata

    parts: list[dict[str, str]] = [{"type": "video"} for _ in videos]
    parts += [{"type": "image"} for _ in images]
    parts.append({"type": "text", "text": text})
    prompt = kit.processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True
    )
    kwargs: dict[str, Any] = {}
    if videos:
        kwargs["videos"] = [v.frames for v in videos]
        kwargs["video_metadata"] = [
            VideoMetadata(
                total_num_frames=len(v.frames), fps=v.fps, frames_indices=list(range(len(v.frames)))
            )
            for v in videos
        ]
        kwargs["do_sample_frames"] = False
    return kit.processor(text=[prompt], images=list(images) or None, return_tensors="pt", **kwargs)


def video_token_id(kit: ModelKit) -> int:
    return int(kit.hf_model.config.video_token_id)


def video_request(
    kit: ModelKit,
    text: str,
    videos: Sequence[Clip],
    images: Sequence[Image.Image] = (),
    *,
    max_tokens: int = 8,
) -> EngineCoreRequest:
    """A complete request whose items carry their tensors, in prompt order."""
    from mmis.engine.execution.model.qwen2_vl import is_video

    inputs = _inputs(kit, text, videos, images)
    ids = [int(t) for t in inputs["input_ids"][0].tolist()]
    batch = {k: v.numpy() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    items = _split(batch)
    runs = sorted(
        [(o, n, "video") for o, n in _runs(ids, video_token_id(kit))]
        + [(o, n, "image") for o, n in _runs(ids, kit.image_token_id)]
    )
    by_kind = {
        "video": [it for it in items if is_video(it)],
        "image": [it for it in items if not is_video(it)],
    }
    if [len(by_kind["video"]), len(by_kind["image"])] != [len(videos), len(images)]:
        raise ValueError(f"split {len(items)} items for {len(videos)} videos, {len(images)} images")
    features = []
    taken = {"video": 0, "image": 0}
    for offset, length, kind in runs:
        data = by_kind[kind][taken[kind]]
        taken[kind] += 1
        pixels = data["pixel_values_videos" if kind == "video" else "pixel_values"]
        digest = hashlib.sha256(kind.encode() + pixels.tobytes()).hexdigest()[:24]
        features.append(
            MultiModalFeature(
                modality=kind,
                mm_hash=digest,
                placeholder=PlaceholderRange(offset, length),
                data=data,
            )
        )
    return EngineCoreRequest(
        request_id=new_id(f"{kit.family}-video"),
        prompt_token_ids=ids,
        mm_features=features,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


def _split(batch: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """The batch per item, with the adapter's own split (images, then videos)."""
    from mmis.engine.execution.model.qwen2_vl import Qwen2VLAdapter

    return Qwen2VLAdapter.split_processor_output(None, batch)  # type: ignore[arg-type]


@torch.inference_mode()
def video_reference(
    kit: ModelKit,
    text: str,
    videos: Sequence[Clip],
    images: Sequence[Image.Image] = (),
    max_tokens: int = 8,
) -> list[int]:
    """Plain transformers ``generate(do_sample=False)`` on the same inputs."""
    inputs = _inputs(kit, text, videos, images)
    out = kit.hf_model.generate(
        **inputs, max_new_tokens=max_tokens, do_sample=False, eos_token_id=[]
    )
    return [int(t) for t in out[0, inputs["input_ids"].shape[1] :].tolist()]
