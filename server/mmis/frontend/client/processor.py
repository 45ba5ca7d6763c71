"""P0's wrapper of the model's Hugging Face processor: prompts, per-image tensors, placeholders.

Invariants:
- Family-agnostic: an image's placeholder length is *measured* by running the model's own
  processor on that image alone and counting its image tokens, never computed from a
  per-family formula; the same count is stored in the sender cache so a shadow hit can expand
  the prompt without touching the pixels again.
- A measured count is reused for a later image with the same kwargs, size and mode whose
  processed tensors have the measured shapes (and values of small integer outputs such as
  ``image_grid_thw``): that image runs the image processor alone (:class:`_Placeholders`),
  skipping the full call's kwargs merging and text expansion; an image of a size not measured
  yet runs the full call only. Per kwargs, the first image also runs the image processor alone
  once: the fast path is used only if its tensors equal the full call's exactly; otherwise
  every image of those kwargs takes the full call.
- The prompt marker of an image (``processor.image_token``, what the chat template writes) and
  its placeholder token (the one repeated per embedding row) may differ: Gemma 3's template
  writes ``<start_of_image>`` and its processor expands it to ``\n\n<start_of_image>`` + N x
  ``<image_soft_token>`` + ``<end_of_image>\n\n``. The text around the placeholder run
  (:attr:`ModelProcessor.image_prefix` / ``image_suffix``) is measured once, at construction,
  from the processor's own output on one small image, and only when marker and placeholder
  differ. A text prompt gets it in text space (:meth:`ModelProcessor.prompt_token_ids`, so the
  neighbouring text tokenizes as in the processor's output); a token-id prompt in token space.
- The prompt is then tokenized with exactly one placeholder token per image (special tokens are
  atomic, so this equals tokenizing the fully expanded text) and expanded in token space. One
  image is one contiguous placeholder run: a processor that splits an image into several runs
  (Gemma 3's pan-and-scan crops) is refused with a :class:`PromptError`.
- Per-image tensors exclude the text outputs (input_ids, attention_mask, token-type ids):
  what remains is exactly what the engine's vision encoder needs for that item.
- ``processor_kwargs`` (``--processor-kwargs``) go to every processor call on an image; the
  renderer hashes the same mapping into each content mm_hash, so changing them changes
  both the tensors and the hashes.
- Image calls (:meth:`ModelProcessor.process_image`) run on the single multimodal worker
  thread only. Text calls (:meth:`tokenize`, :meth:`decode`, :meth:`chat_prompt`) may run
  on any thread: they pass the tokenizer's default arguments, so they never change its
  truncation or padding state (the one mutation a fast tokenizer refuses concurrently).
- ``detail`` (an image part's ``image_url.detail``): ``low`` renders the image at the
  processor's *minimum* pixel budget (:meth:`ModelProcessor.image_kwargs`): for processors with a
  pixel budget (Qwen2-VL family: ``size`` with ``shortest_edge``/``longest_edge`` in pixels)
  both bounds become the minimum; processors with a fixed input size (LLaVA's CLIP/SigLIP) have
  one rendering, so ``low`` changes nothing there. ``auto``/``high``/absent use the processor's
  own limits (and ``--processor-kwargs``). The kwargs of the chosen rendering are hashed into
  the item's mm_hash, so the two renderings of one image are two cache items.
- Videos (processors that declare a ``video_token``: the Qwen2-VL family): the template writes
  one video token per video part; :meth:`ModelProcessor.process_video` runs the processor on
  one video's already sampled frames (``do_sample_frames=False``, the sampled rate as its
  metadata, ``processor_kwargs``) and counts its video tokens; :meth:`ModelProcessor.expand`
  replaces each item's own placeholder token (image or video), in prompt order.
- :attr:`ModelProcessor.max_token_chars` is the longest token of the vocabulary in
  characters: a text of ``c`` characters has at least ``c / max_token_chars`` tokens, which
  bounds a prompt from its length before it is tokenized.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmis.frontend.client.fast_image import install as install_fast_image
from mmis.protocol.messages import PlaceholderRange

_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})


class PromptError(ValueError):
    """The prompt and its images do not line up (e.g. an image part the template dropped)."""


@dataclass(frozen=True)
class ProcessedImage:
    tensors: dict[str, np.ndarray]
    num_tokens: int


class ModelProcessor:
    def __init__(self, processor: Any, processor_kwargs: Mapping[str, Any] | None = None) -> None:
        self.processor = processor
        # no channels-first copy of a PIL image before the resize (same tensors; issue 45)
        install_fast_image(getattr(processor, "image_processor", None))
        self.tokenizer = getattr(processor, "tokenizer", processor)
        token = getattr(processor, "image_token", None)
        if token is None:
            raise PromptError("the model's processor declares no image token")
        self.image_token: str = token  # the prompt marker
        self.marker_token_id: int = int(self.tokenizer.convert_tokens_to_ids(token))
        placeholder = getattr(self.tokenizer, "image_token", None) or token
        self.placeholder_token: str = str(placeholder)
        self.image_token_id: int = int(self.tokenizer.convert_tokens_to_ids(placeholder))
        video = getattr(processor, "video_token", None)
        self.video_token: str | None = None if video is None else str(video)
        self.video_token_id: int | None = (
            None if video is None else int(self.tokenizer.convert_tokens_to_ids(video))
        )
        self.processor_kwargs: dict[str, Any] = dict(processor_kwargs or {})
        self.image_prefix, self.image_suffix = ("", "")
        if self.image_token_id != self.marker_token_id:
            self.image_prefix, self.image_suffix = self._measure_wrap()
        self._low_detail = _low_detail_kwargs(processor, self.processor_kwargs)
        self._placeholders = _Placeholders(self)
        vocab = self.tokenizer.get_vocab()
        self.max_token_chars: int = max((len(t) for t in vocab), default=1) or 1

    @classmethod
    def from_pretrained(
        cls,
        model: str,
        processor_kwargs: Mapping[str, Any] | None = None,
        *,
        revision: str | None = None,
        **kwargs: Any,
    ) -> ModelProcessor:
        """Load the processor (and its tokenizer) of ``model`` at ``revision``."""
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(model, revision=revision, **kwargs)
        return cls(processor, processor_kwargs)

    # ------------------------------------------------------------------ text
    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render OpenAI-style messages (images as ``{"type": "image"}`` parts) to text; the
        template writes ``tools`` (OpenAI tool definitions) where it supports them."""
        text = self.processor.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=True,
            tokenize=False,
        )
        return str(text)

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer(text)["input_ids"]]

    def prompt_token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """A prompt's ids with one placeholder token per image marker (see the docstring)."""
        if self.image_token_id == self.marker_token_id:
            return self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        wrapped = self.image_prefix + self.placeholder_token + self.image_suffix
        if isinstance(prompt, str):
            return self.tokenize(prompt.replace(self.image_token, wrapped))
        inner = self.tokenizer(wrapped, add_special_tokens=False)["input_ids"]
        ids: list[int] = []
        for t in prompt:
            if int(t) == self.marker_token_id:
                ids.extend(int(x) for x in inner)
            else:
                ids.append(int(t))
        return ids

    def _measure_wrap(self) -> tuple[str, str]:
        """The text the processor writes around one image's placeholder run."""
        from PIL import Image

        out = self.processor(
            text=[self.image_token],
            images=[Image.new("RGB", (64, 64), (128, 128, 128))],
            return_tensors="np",
            **self.processor_kwargs,
        )
        ids = [int(t) for t in np.asarray(out["input_ids"])[0]]
        lead = [int(t) for t in self.tokenizer("")["input_ids"]]  # e.g. a BOS it adds
        if lead and ids[: len(lead)] == lead:
            ids = ids[len(lead) :]
        runs = _runs(ids, self.image_token_id)
        if len(runs) != 1:
            raise PromptError(
                f"the processor expands one image into {len(runs)} placeholder runs; "
                "only one contiguous run per image is supported"
            )
        lo, hi = runs[0]

        def text(part: list[int]) -> str:
            return str(self.tokenizer.decode(part, skip_special_tokens=False))

        return text(ids[:lo]), text(ids[hi:])

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (what logprobs show for it)."""
        return str(self.tokenizer.decode([int(token_id)], skip_special_tokens=False))

    @property
    def eos_token_id(self) -> int | None:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return None if eos is None else int(eos)

    # ------------------------------------------------------------------ images
    def image_kwargs(self, detail: str | None = None) -> dict[str, Any]:
        """The processor kwargs of one image part with this ``detail`` (see the docstring)."""
        if detail == "low":
            return dict(self._low_detail)
        return dict(self.processor_kwargs)

    def process_image(self, image: Any, kwargs: Mapping[str, Any] | None = None) -> ProcessedImage:
        """Process one image with ``kwargs`` (default: ``processor_kwargs``): the image processor
        alone where a count measured earlier applies (see the docstring), else the full call."""
        kwargs = self.processor_kwargs if kwargs is None else kwargs
        return self._placeholders.process(image, kwargs)

    def process_image_fully(self, image: Any, kwargs: Mapping[str, Any]) -> ProcessedImage:
        """The processor's full call on one image: tensors and the measured placeholder count."""
        out = self.processor(text=[self.image_token], images=[image], return_tensors="np", **kwargs)
        ids = np.asarray(out["input_ids"]).reshape(-1)
        num = int(np.count_nonzero(ids == self.image_token_id))
        if len(_runs([int(t) for t in ids], self.image_token_id)) > 1:
            raise PromptError(
                "the processor split this image into several placeholder runs (e.g. pan-and-scan "
                "crops); only one contiguous run per image is supported"
            )
        tensors = _image_tensors(out)
        if num <= 0 or not tensors:
            raise PromptError("the processor produced no image tokens for an image")
        return ProcessedImage(tensors=tensors, num_tokens=num)

    def process_video(self, video: Any, kwargs: Mapping[str, Any] | None = None) -> ProcessedImage:
        """Run the processor on one video's sampled frames (``video.frames`` ``[T, H, W, 3]``
        at ``video.fps``), with ``kwargs`` (default: ``processor_kwargs``)."""
        if self.video_token is None or self.video_token_id is None:
            raise PromptError("this model's processor takes no video")
        from transformers.video_utils import VideoMetadata

        count = int(video.frames.shape[0])
        metadata = VideoMetadata(
            total_num_frames=count, fps=float(video.fps), frames_indices=list(range(count))
        )
        out = self.processor(
            text=[self.video_token],
            videos=[video.frames],
            video_metadata=[metadata],
            do_sample_frames=False,
            return_tensors="np",
            **(self.processor_kwargs if kwargs is None else kwargs),
        )
        ids = np.asarray(out["input_ids"]).reshape(-1)
        num = int(np.count_nonzero(ids == self.video_token_id))
        tensors = _image_tensors(out)
        if num <= 0 or "video_grid_thw" not in tensors:
            raise PromptError("the processor produced no video tokens for a video")
        return ProcessedImage(tensors=tensors, num_tokens=num)

    def expand(
        self,
        token_ids: Sequence[int],
        counts: Sequence[int],
        tokens: Sequence[int] | None = None,
    ) -> tuple[list[int], list[PlaceholderRange]]:
        """Replace the k-th placeholder token by ``counts[k]`` copies of it; return ids and
        ranges. ``tokens[k]`` is item k's placeholder token (default: all images)."""
        wanted = [self.image_token_id] * len(counts) if tokens is None else list(tokens)
        kinds = {self.image_token_id} | (
            {self.video_token_id} if self.video_token_id is not None else set()
        )
        slots = [i for i, t in enumerate(token_ids) if t in kinds]
        if len(slots) != len(counts) or len(wanted) != len(counts):
            raise PromptError(
                f"the prompt has {len(slots)} media placeholder(s) for {len(counts)} item(s)"
            )
        for slot, token in zip(slots, wanted, strict=True):
            if token_ids[slot] != token:
                raise PromptError("the prompt's image and video placeholders are out of order")
        ids: list[int] = []
        ranges: list[PlaceholderRange] = []
        prev = 0
        for slot, count, token in zip(slots, counts, wanted, strict=True):
            ids.extend(token_ids[prev:slot])
            ranges.append(PlaceholderRange(offset=len(ids), length=int(count)))
            ids.extend([token] * int(count))
            prev = slot + 1
        ids.extend(token_ids[prev:])
        return ids, ranges


def _runs(ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each maximal run of ``token`` in ``ids``."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _low_detail_kwargs(processor: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the pixel budget pinned to its minimum, for processors that have one."""
    image_processor = getattr(processor, "image_processor", None)
    size = kwargs.get("size", getattr(image_processor, "size", None))
    get = size.get if isinstance(size, Mapping) else lambda key: getattr(size, key, None)
    low, high = get("shortest_edge"), get("longest_edge")
    pixel_budget = getattr(image_processor, "merge_size", None) is not None
    if not pixel_budget or not isinstance(low, int) or not isinstance(high, int):
        return dict(kwargs)  # a fixed input size: one rendering
    return {**kwargs, "size": {"shortest_edge": low, "longest_edge": low}}


def _image_tensors(out: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A processor output's per-image tensors: its arrays less the text outputs."""
    return {
        k: np.ascontiguousarray(v)
        for k, v in out.items()
        if k not in _TEXT_KEYS and isinstance(v, np.ndarray)
    }


def _image_key(image: Any) -> tuple[Any, ...] | None:
    """What a processor may read from an image besides its pixels: size and mode."""
    size, mode = getattr(image, "size", None), getattr(image, "mode", None)
    if isinstance(size, tuple) and isinstance(mode, str):  # a PIL image
        return (size, mode)
    if isinstance(image, np.ndarray):
        return (image.shape, image.dtype.str)
    return None


def _tensor_key(tensors: Mapping[str, np.ndarray]) -> tuple[Any, ...]:
    """Shapes and dtypes of processed tensors, with the values of small integer ones
    (``image_grid_thw``, ``image_sizes``, ``num_crops``): what a text expansion reads."""
    return tuple(
        (k, v.shape, v.dtype.str, v.tobytes() if v.dtype.kind in "biu" and v.size <= 64 else None)
        for k, v in sorted(tensors.items())
    )


def _same_tensors(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a
    )


class _Placeholders:
    """:meth:`ModelProcessor.process_image`'s memo of measured placeholder counts (see the
    module docstring). Used from the multimodal worker thread only."""

    max_entries = 4096  # least recently used sizes beyond this are measured again

    def __init__(self, owner: ModelProcessor) -> None:
        self.owner = owner
        self.image_processor = getattr(owner.processor, "image_processor", None)
        self.direct: dict[str, bool] = {}  # kwargs -> the image processor alone agrees
        # (kwargs, size and mode) -> (the processed tensors' key, the measured count)
        self.counts: OrderedDict[tuple[Any, ...], tuple[tuple[Any, ...], int]] = OrderedDict()

    def process(self, image: Any, kwargs: Mapping[str, Any]) -> ProcessedImage:
        which, shape = json.dumps(kwargs, sort_keys=True, default=repr), _image_key(image)
        agrees = self.direct.get(which)
        if self.image_processor is None or shape is None or agrees is False:
            return self.owner.process_image_fully(image, kwargs)
        known = self.counts.get((which, shape))
        if known is None or agrees is None:  # a size not measured yet: one full call
            full = self.owner.process_image_fully(image, kwargs)
            if agrees is None:  # the first image with these kwargs: compare the paths once
                alone = self._alone(image, kwargs)
                self.direct[which] = alone is not None and _same_tensors(alone, full.tensors)
            self._keep((which, shape), _tensor_key(full.tensors), full.num_tokens)
            return full
        tensors = self._alone(image, kwargs)
        if tensors is None:
            self.direct[which] = False
            return self.owner.process_image_fully(image, kwargs)
        signature, count = known
        if _tensor_key(tensors) != signature:  # other shapes than measured: measure again
            full = self.owner.process_image_fully(image, kwargs)
            self._keep((which, shape), _tensor_key(full.tensors), full.num_tokens)
            return full
        self.counts.move_to_end((which, shape))
        return ProcessedImage(tensors=tensors, num_tokens=count)

    def _alone(self, image: Any, kwargs: Mapping[str, Any]) -> dict[str, np.ndarray] | None:
        try:
            out = self.image_processor(images=[image], return_tensors="np", **kwargs)  # type: ignore[misc]
        except Exception:  # kwargs meant for the processor's text side, a processor quirk
            return None
        return _image_tensors(out)

    def _keep(self, key: tuple[Any, ...], signature: tuple[Any, ...], count: int) -> None:
        self.counts[key] = (signature, count)
        self.counts.move_to_end(key)
        while len(self.counts) > self.max_entries:
            self.counts.popitem(last=False)
