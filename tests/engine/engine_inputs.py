"""Test-side P0 stand-in: engine requests from text + images, and the transformers reference.

Invariants:
- The prompt and the image tensors come from the model's own Hugging Face processor run once
  on the whole request, exactly as the reference ``generate()`` sees them; each item's tensors
  are that output split per image (numpy, as on the wire); any-resolution items keep only
  their own tiles (the batch's zero padding dropped) and their ``image_sizes`` row.
- An item's ``mm_hash`` is a digest of its pixel tensors, so the same image
  always gets the same hash and different images never share one.
- The reference is plain ``transformers`` ``generate(do_sample=False)`` with no early stop;
  engine requests use ``ignore_eos`` and the same ``max_tokens`` so the two are comparable.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
from PIL import Image

from mmis.protocol.messages import (
    EngineCoreRequest,
    MultiModalFeature,
    PlaceholderRange,
    SamplingParams,
)

_IDS = itertools.count()


def new_id(prefix: str = "r") -> str:
    return f"{prefix}-{next(_IDS)}"


def image(seed: int, size: tuple[int, int] = (64, 64)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8))


def _runs(ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


@dataclasses.dataclass
class ModelKit:
    """One tiny model family, loaded in the test process."""

    family: str
    path: Path
    processor: Any
    hf_model: Any

    @classmethod
    def load(cls, family: str, path: Path) -> ModelKit:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        return cls(family, path, AutoProcessor.from_pretrained(path), hf)

    @property
    def image_token_id(self) -> int:
        return int(self.hf_model.config.image_token_id)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_model.config.get_text_config().vocab_size)

    def inputs(self, text: str, images: Sequence[Image.Image]) -> Any:
        parts: list[dict[str, str]] = [{"type": "image"} for _ in images]
        parts.append({"type": "text", "text": text})
        prompt = self.processor.apply_chat_template(
            [{"role": "user", "content": parts}], add_generation_prompt=True
        )
        return self.processor(text=[prompt], images=list(images) or None, return_tensors="pt")

    def _split(self, inputs: Any, count: int) -> list[dict[str, np.ndarray]]:
        pixels = inputs["pixel_values"].numpy() if count else None
        if count and inputs.get("image_sizes") is not None:
            return self._split_tiles(inputs, pixels, count)
        grids = inputs.get("image_grid_thw")
        if grids is None:
            return [{"pixel_values": pixels[i : i + 1]} for i in range(count)]  # type: ignore[index]
        items, row = [], 0
        for i in range(count):
            rows = int(grids[i].prod())
            items.append(
                {
                    "pixel_values": pixels[row : row + rows],  # type: ignore[index]
                    "image_grid_thw": grids[i : i + 1].numpy(),
                }
            )
            row += rows
        return items

    @staticmethod
    def _split_tiles(inputs: Any, pixels: Any, count: int) -> list[dict[str, np.ndarray]]:
        """Any-resolution families (LLaVA-NeXT, OneVision): ``pixel_values`` is ``[images,
        tiles, 3, S, S]``, zero-padded to the request's most tiles; each item keeps its own
        tiles (the trailing all-zero ones are the padding), its ``image_sizes`` row and, when
        the processor gives ``batch_num_images``, its prompt's image count."""
        sizes = inputs["image_sizes"].numpy()
        found = inputs.get("batch_num_images")
        per_prompt = None if found is None else [int(n) for n in found for _ in range(int(n))]
        items = []
        for i in range(count):
            keep = pixels.shape[1]
            while keep > 1 and not pixels[i, keep - 1].any():
                keep -= 1
            item = {"pixel_values": pixels[i : i + 1, :keep], "image_sizes": sizes[i : i + 1]}
            if per_prompt is not None:
                item["batch_num_images"] = np.asarray([per_prompt[i]], dtype=np.int64)
            items.append(item)
        return items

    def request(
        self,
        text: str,
        images: Sequence[Image.Image] = (),
        *,
        max_tokens: int = 8,
        request_id: str | None = None,
        n: int = 1,
    ) -> EngineCoreRequest:
        """A complete request: every item carries its tensors."""
        inputs = self.inputs(text, images)
        ids = [int(t) for t in inputs["input_ids"][0].tolist()]
        runs = _runs(ids, self.image_token_id)
        tensors = self._split(inputs, len(images))
        if len(runs) != len(tensors):
            raise ValueError(f"{len(runs)} placeholder runs for {len(tensors)} images")
        features = []
        for (offset, length), data in zip(runs, tensors, strict=True):
            digest = hashlib.sha256(data["pixel_values"].tobytes()).hexdigest()[:24]
            placeholder = PlaceholderRange(offset, length)
            features.append(
                MultiModalFeature(
                    modality="image", mm_hash=digest, placeholder=placeholder, data=data
                )
            )
        return EngineCoreRequest(
            request_id=request_id or new_id(self.family),
            prompt_token_ids=ids,
            mm_features=features,
            sampling_params=SamplingParams(
                n=n, temperature=0.0, max_tokens=max_tokens, ignore_eos=True
            ),
        )

    @torch.inference_mode()
    def reference(
        self, text: str, images: Sequence[Image.Image] = (), max_tokens: int = 8
    ) -> list[int]:
        inputs = self.inputs(text, images)
        out = self.hf_model.generate(
            **inputs, max_new_tokens=max_tokens, do_sample=False, eos_token_id=[]
        )
        return [int(t) for t in out[0, inputs["input_ids"].shape[1] :].tolist()]

    @torch.inference_mode()
    def reference_embedding(self, text: str, images: Sequence[Image.Image] = ()) -> np.ndarray:
        """Mean of the language model's final hidden states over the prompt, L2-normalised."""
        hidden = self.hf_model.model(**self.inputs(text, images)).last_hidden_state[0]
        vector = torch.nn.functional.normalize(hidden.float().mean(dim=0), dim=-1)
        return np.asarray(vector.numpy(), dtype=np.float32)


def renamed(request: EngineCoreRequest, request_id: str | None = None) -> EngineCoreRequest:
    """The same request under a fresh id (a resend)."""
    return msgspec.structs.replace(request, request_id=request_id or new_id("resend"))


def hash_only(request: EngineCoreRequest, which: Sequence[int] | None = None) -> EngineCoreRequest:
    """A copy whose items ``which`` (all by default) carry ``data=None``: a shadow hit."""
    chosen = set(range(len(request.mm_features)) if which is None else which)
    features = [
        msgspec.structs.replace(f, data=None) if i in chosen else f
        for i, f in enumerate(request.mm_features)
    ]
    return msgspec.structs.replace(request, request_id=new_id("hash"), mm_features=features)


_KITS: dict[str, ModelKit] = {}


def kit_for(family: str, path: Path) -> ModelKit:
    """One loaded :class:`ModelKit` per model directory for the whole session."""
    key = str(path)
    if key not in _KITS:
        _KITS[key] = ModelKit.load(family, path)
    return _KITS[key]


def with_data(request: EngineCoreRequest, data: Sequence[Any]) -> EngineCoreRequest:
    """A copy (fresh id) whose items carry ``data[i]`` (tensors, an address or None)."""
    features = [
        msgspec.structs.replace(f, data=d) for f, d in zip(request.mm_features, data, strict=True)
    ]
    return msgspec.structs.replace(request, request_id=new_id("data"), mm_features=features)


def placeholder_end(request: EngineCoreRequest) -> int:
    return max(f.placeholder.offset + f.placeholder.length for f in request.mm_features)
