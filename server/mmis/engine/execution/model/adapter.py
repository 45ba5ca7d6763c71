"""The one interface the runner uses to drive a Hugging Face image-text model.

An adapter wraps an UNMODIFIED ``AutoModelForImageTextToText`` model and exposes the pieces
the runner composes itself: token embedding, the vision encoder (tower + projector), position
ids, the language model forward over a packed batch with paged attention, and the LM head.

Invariants:
- The language model's attention is switched to :data:`ATTENTION_NAME` (our paged kernel);
  the vision tower keeps its own implementation.
- ``encode_images`` runs the encoder once for all given items and returns one
  ``[num_placeholder_tokens(item), hidden]`` tensor per item, in order.
- ``positions`` returns ``[n]`` (1-D RoPE) or ``[3, n]`` (M-RoPE) for prompt/decode positions
  ``start .. start + n - 1``; it depends only on the item layout, never on runner state.
- Bad item tensors raise :class:`ModelInputError` with a message that names the problem.
- A model the paged kernel cannot run exactly is refused when the adapter is built
  (:class:`UnsupportedModelError`, naming what): attention other than causal attention
  (``layer_types`` other than ``full_attention``; ``sliding_attention`` and
  ``use_sliding_window`` only for an adapter with ``sliding_windows``, whose layers pass their
  window to the kernel; bidirectional text attention; attention-logit soft-capping), or a
  decoder layer whose attention lacks its own ``layer_idx`` (it would read and write another
  layer's KV).
- :meth:`ModelAdapter.load` fuses each decoder layer's q/k/v and gate/up projections into one
  matmul each and runs the language model's RMSNorms as torch's ``rms_norm``
  (``model/fused.py``), unless ``fuse=False``; the logits are those of the unfused model.
- :meth:`ModelAdapter.load` draws transformers' weight-loading progress bar only when stderr
  is a terminal: in a container's log its ``\r`` frames are noise (:func:`quiet_progress`).
"""

from __future__ import annotations

import abc
import contextlib
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from mmis.engine.execution.attn_metadata import AttentionMetadata
from mmis.engine.execution.paged_attention import ATTENTION_NAME, STEP_KWARG, KVCacheSpec, PagedStep
from mmis.engine.scheduling.sched_output import MultiModalInput, ScheduledRequest
from mmis.protocol.errors import MMISError
from mmis.protocol.messages import ErrorCode


class UnsupportedModelError(ValueError):
    """The checkpoint's family has no adapter, or the engine cannot run it exactly."""


def check_exact(text_config: Any, language_model: Any, *, sliding_windows: bool = False) -> None:
    """Refuse what the paged attention path would silently run differently."""
    known = {"full_attention", "sliding_attention"} if sliding_windows else {"full_attention"}
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types:
        other = sorted({str(t) for t in layer_types} - known)
        if other:
            raise UnsupportedModelError(
                f"attention types {other} in the model's layer_types are not supported for "
                f"this family (supported: {sorted(known)})"
            )
    if getattr(text_config, "use_sliding_window", False) and not sliding_windows:
        raise UnsupportedModelError(
            f"sliding-window attention (use_sliding_window, window "
            f"{getattr(text_config, 'sliding_window', None)}) is not supported for this family"
        )
    if getattr(text_config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            "bidirectional text attention (use_bidirectional_attention) is not supported"
        )
    if getattr(text_config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedModelError("attention-logit soft-capping is not supported")
    for i, layer in enumerate(getattr(language_model, "layers", ())):
        attention = getattr(layer, "self_attn", None)
        found = getattr(attention, "layer_idx", None)
        if found != i:
            raise UnsupportedModelError(
                f"decoder layer {i}'s attention has layer_idx {found!r}, not {i}: the engine "
                "keys each layer's KV cache by it"
            )


class ModelInputError(MMISError, ValueError):
    """Multimodal item tensors that the model cannot use."""

    code = ErrorCode.INVALID_REQUEST.value


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """transformers' progress bars off within the block unless stderr is a terminal (then
    left as they are); turned back on afterwards if this turned them off."""
    from transformers.utils import logging as hf_logging

    tty = getattr(sys.stderr, "isatty", lambda: False)()
    if tty or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def as_tensor(value: Any, name: str) -> torch.Tensor:
    """A processor output (numpy array or tensor) as a torch tensor, or a typed error."""
    if value is None:
        raise ModelInputError(f"multimodal item is missing tensor {name!r}")
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ModelInputError(f"tensor {name!r} is not numeric: {exc}") from exc


class ModelAdapter(abc.ABC):
    """Family-specific glue around one loaded model."""

    family: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    # image tokens attend to their whole image (Gemma 3): passed as mask spans, not tensors
    bidirectional_images: ClassVar[bool] = False
    # its layers pass their sliding window to the attention call (Gemma 3): allowed
    sliding_windows: ClassVar[bool] = False

    def __init__(self, model: Any, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        text = model.config.get_text_config()
        self.text_config = text
        self.hidden_size = int(text.hidden_size)
        self.vocab_size = int(text.vocab_size)
        self.num_layers = int(text.num_hidden_layers)
        self.num_heads = int(text.num_attention_heads)
        self.num_kv_heads = int(getattr(text, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(text, "head_dim", None) or self.hidden_size // self.num_heads)
        # module name -> this rank's tensor_parallel.Shard of each split projection (set by
        # tensor_parallel.shard_adapter; engine/lora/ splits its adapters the same way)
        self.tp_shards: dict[str, Any] = {}
        # every end-of-sequence id the checkpoint declares stops a request (Qwen2-VL's
        # generation_config lists <|im_end|> and <|endoftext|>; its config only one)
        found: list[int] = []
        for source in (model.generation_config, model.config, text):
            eos = getattr(source, "eos_token_id", None)
            for e in eos if isinstance(eos, list | tuple) else [eos]:
                if e is not None and int(e) not in found:
                    found.append(int(e))
        self.eos_token_ids: tuple[int, ...] = tuple(found)
        check_exact(text, self.language_model, sliding_windows=self.sliding_windows)

    # -- construction -------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        path_or_id: str | Path,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        revision: str | None = None,
        fuse: bool = True,
    ) -> ModelAdapter:
        """``from_pretrained`` at ``revision`` (CUDA when available, else CPU) with paged text
        attention; the weights load straight onto the device (``device_map``). ``fuse``: merge
        each decoder layer's q/k/v and gate/up into one matmul and run its RMSNorms as torch's
        ``rms_norm`` (``model/fused.py``; off only to measure or debug the plain layers)."""
        from transformers import AutoModelForImageTextToText

        dev = torch.device(device) if device is not None else default_device()
        dt = dtype if dtype is not None else default_dtype(dev)
        with quiet_progress():
            model: Any = AutoModelForImageTextToText.from_pretrained(
                str(path_or_id), dtype=dt, revision=revision, device_map=dev
            )
        model = model.to(dev).eval()  # a no-op once device_map placed every weight
        model.set_attn_implementation({"text_config": ATTENTION_NAME})
        adapter = cls(model, dev, dt)
        if fuse:
            from mmis.engine.execution.model.fused import fuse_adapter

            fuse_adapter(adapter)
        return adapter

    def kv_cache_spec(self, block_size: int) -> KVCacheSpec:
        return KVCacheSpec(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            device=self.device,
            block_size=block_size,
        )

    # -- the pieces ------------------------------------------------------------------------
    @property
    def language_model(self) -> Any:
        return self.model.model.language_model

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[n]`` token ids -> ``[n, hidden]`` embeddings."""
        embeddings: torch.Tensor = self.model.get_input_embeddings()(token_ids.to(self.device))
        return embeddings

    @abc.abstractmethod
    def encode_images(self, items: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
        """Processor tensors of k items -> k tensors ``[placeholder_tokens, hidden]``."""

    @abc.abstractmethod
    def num_placeholder_tokens(self, item: Mapping[str, Any]) -> int:
        """How many placeholder tokens the item's processor tensors expand to."""

    def positions(
        self, start: int, num_tokens: int, items: Sequence[MultiModalInput]
    ) -> torch.Tensor:
        """Position ids of ``start .. start + num_tokens - 1``: ``[n]`` or ``[3, n]``; plain
        1-D here (position p is p), M-RoPE families override it."""
        return torch.arange(start, start + num_tokens, dtype=torch.long)

    def split_processor_output(self, batch: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Split a processor output holding k images into k per-item tensor dicts; here one
        ``pixel_values`` row per image (fixed-size towers), families with more override it."""
        pixels = batch.get("pixel_values")
        if pixels is None:
            return []
        return [{"pixel_values": pixels[i : i + 1]} for i in range(len(pixels))]

    def step_positions(
        self, seqs: Sequence[ScheduledRequest], meta: AttentionMetadata
    ) -> torch.Tensor:
        """The step's ``position_ids``: for 1-D RoPE the metadata's as they are (``[1, N]``,
        built with the step's metadata); an adapter that overrides :meth:`positions` gets
        them per sequence."""
        if type(self).positions is ModelAdapter.positions:
            return meta.positions.unsqueeze(0)
        return self.pack_positions(
            [self.positions(s.start_position, s.num_tokens, s.mm_items) for s in seqs]
        )

    def host_positions(self, seqs: Sequence[ScheduledRequest]) -> np.ndarray | None:
        """The step's ``position_ids`` on the host (``[N]`` or ``[3, N]`` int64), for the
        step's one upload (``runner.py``), or None when they are the metadata's 1-D
        positions (plain RoPE: in that upload already)."""
        if type(self).positions is ModelAdapter.positions:
            return None
        per_sequence = [self.positions(s.start_position, s.num_tokens, s.mm_items) for s in seqs]
        return torch.cat(per_sequence, dim=-1).numpy()

    def bidirectional_spans(
        self, seqs: Sequence[ScheduledRequest]
    ) -> list[list[tuple[int, int]]] | None:
        """Per sequence, the image ranges attended bidirectionally (None: causal only)."""
        if not self.bidirectional_images:
            return None
        return [[(item.offset, item.end) for item in s.mm_items] for s in seqs]

    def pack_positions(self, per_sequence: Sequence[torch.Tensor]) -> torch.Tensor:
        """Concatenate per-sequence positions into the language model's ``position_ids``."""
        packed = torch.cat(list(per_sequence), dim=-1).to(self.device)
        return packed.unsqueeze(-2)  # [1, N] or [3, 1, N]

    def forward(
        self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, step: PagedStep
    ) -> torch.Tensor:
        """Packed ``[N, hidden]`` embeddings -> final hidden states ``[N, hidden]``."""
        out = self.language_model(
            inputs_embeds=inputs_embeds.unsqueeze(0),
            position_ids=position_ids,
            use_cache=False,
            **{STEP_KWARG: step},
        )
        hidden: torch.Tensor = out.last_hidden_state[0]
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model.lm_head(hidden)
        return logits.float()

    def reference_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """The model's own forward over a text prompt with transformers' SDPA attention (the
        paged attention runs only inside the runner), then the paged attention back: the
        start-up self-check's reference (``engine/self_check.py``)."""
        self.model.set_attn_implementation({"text_config": "sdpa"})
        try:
            out = self.model(input_ids=torch.tensor([list(ids)], device=self.device))
        finally:
            self.model.set_attn_implementation({"text_config": ATTENTION_NAME})
        logits: torch.Tensor = out.logits
        return logits
