"""P1's check of an encoder output it receives in place of an item's pixels (E/PD, issue 46).

An item whose resolved data holds :data:`~mmis.protocol.encoder.MM_EMBEDS` (relayed by P0
from an ``mmis encoder``, or a client's ``image_embeds`` part) skips P1's vision tower: the
runner splices those rows as they are (``engine/execution/encoder_store.py``). So P1
checks them first, on its input thread, right after the receiver resolved the item
(``engine/core_process.py``); anything wrong is answered as a receiver-cache miss, so P0's one
drift retry resends the pixels and P1 encodes locally (docs/ARCHITECTURE.md, "Encoder
disaggregation").

Invariants:
- An encoder output is accepted only as exactly what the model's own tower would give:
  2-D, ``[placeholder length, hidden size]`` (the language model's embedding width: what
  every family's ``ModelAdapter.encode_images`` returns), in the engine's model dtype (no
  silent cast: a float32 engine given bfloat16 rejects it), every value finite, and no pixel
  tensor (:data:`~mmis.protocol.encoder.PIXEL_KEYS`) beside it. The metadata tensors beside
  it (Qwen2-VL's ``image_grid_thw``) are not judged here (admission counts them).
- Pure and torch-free to import: numpy arrays are checked with numpy; a torch tensor (the
  wire decodes ``bfloat16`` as one, ``protocol/tensors.py``) with its own methods, found by
  duck typing. Never raises for bad input: every problem is a :class:`Rejection`.
- :data:`REASONS` is the closed label set of ``mmis_encoder_outputs_rejected_total{reason}``
  (declared once, in ``telemetry/catalog.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from mmis.protocol.encoder import MM_EMBEDS, PIXEL_KEYS
from mmis.telemetry.catalog import ENCODER_REJECT_REASONS

REASONS = ENCODER_REJECT_REASONS
"""Why an encoder output was refused (a rejection names exactly one): the label values of
``mmis_encoder_outputs_rejected_total{reason}``."""


@dataclasses.dataclass(frozen=True)
class EmbedsSpec:
    """What this engine accepts as an encoder output: its model's dtype name (``float32``,
    ``bfloat16``, ...: torch's name without ``torch.``) and its language model's hidden size."""

    dtype: str
    hidden_size: int


@dataclasses.dataclass(frozen=True)
class Rejection:
    reason: str  # one of REASONS
    message: str


def dtype_name(tensor: Any) -> str:
    """``float32`` for a numpy float32 array and a ``torch.float32`` tensor alike."""
    return str(getattr(tensor, "dtype", type(tensor).__name__)).removeprefix("torch.")


def _is_torch(tensor: Any) -> bool:
    return type(tensor).__module__.split(".", 1)[0] == "torch"


def _all_finite(tensor: Any) -> bool:
    if _is_torch(tensor):
        return bool(tensor.isfinite().all())
    return bool(np.isfinite(tensor).all())


def check_embeds(
    data: Mapping[str, Any], placeholder_length: int, spec: EmbedsSpec, mm_hash: str = ""
) -> Rejection | None:
    """``None`` if ``data[MM_EMBEDS]`` may be used as the item's encoder output, else why not."""
    name = f"item {mm_hash}: " if mm_hash else ""
    pixels = sorted(key for key in PIXEL_KEYS if key in data)
    if pixels:
        return Rejection(
            "pixels", f"{name}an encoder output must replace the pixels, found {pixels} beside it"
        )
    embeds = data[MM_EMBEDS]
    if not (isinstance(embeds, np.ndarray) or _is_torch(embeds)):
        return Rejection(
            "shape", f"{name}an encoder output must be a tensor, got {type(embeds).__name__}"
        )
    got = dtype_name(embeds)
    if got != spec.dtype:
        return Rejection(
            "dtype", f"{name}an encoder output must be {spec.dtype} (the model's dtype), got {got}"
        )
    shape = tuple(int(n) for n in embeds.shape)
    expected = (placeholder_length, spec.hidden_size)
    if shape != expected:
        return Rejection(
            "shape",
            f"{name}an encoder output must be {list(expected)} (placeholder tokens, hidden "
            f"size), got {list(shape)}",
        )
    if not _all_finite(embeds):
        return Rejection("nonfinite", f"{name}an encoder output holds NaN or infinite values")
    return None
