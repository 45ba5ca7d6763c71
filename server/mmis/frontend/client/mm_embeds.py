"""Precomputed image embeddings as input (``--enable-mm-embeds``, issue 46 item 4): an
``image_embeds`` chat part's .npy bytes decoded, checked and cast to the engine's dtype.

Invariants:
- :func:`decode_embeds` accepts only base64 of a 2-D float .npy (:data:`EMBEDS_DTYPES`) of at
  most ``max_bytes``, with finite values; its header is checked before the array is
  allocated, nothing is unpickled. Anything else is an :class:`InvalidRequestError` (a 400)
  naming the problem, never a 5xx.
- With the engine's model dtype (``dtype``: P1's ``hello``, ``EngineClient.engine_info``) the
  array is cast to it (users send float32; numpy has no bfloat16, so a bfloat16 engine gets a
  ``torch.bfloat16`` tensor, which the wire carries): P1 refuses any other dtype (no silent
  cast there, ``engine/encoder_inputs.py``), so without the cast the item would be a miss whose
  retry has no pixels (a 503). Values the cast turns non-finite (beyond float16's range) are a
  400. A dtype P0 does not know (or none yet) leaves the array as sent: P1 judges it.
- The mm_hash is taken over the client's bytes (the renderer's ``_embeds_item``), before the
  cast: one content, one hash, on every engine of a model (they share one dtype).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from mmis.frontend.errors import InvalidRequestError
from mmis.protocol.encoder import MM_EMBEDS

EMBEDS_DTYPES = ("float16", "float32")
"""The .npy dtypes an ``image_embeds`` part may have (numpy has no bfloat16)."""

CASTS = ("bfloat16", "float16", "float32")
"""The engine dtypes P0 casts an ``image_embeds`` array to."""


@dataclasses.dataclass(frozen=True)
class PrecomputedEmbeds:
    """An ``image_embeds`` part's content (``--enable-mm-embeds``): the tensors sent as the
    item's data, ``{MM_EMBEDS: [num_tokens, hidden]}`` (+ ``image_grid_thw``), which P1
    checks like an encoder's output and uses instead of encoding."""

    tensors: dict[str, Any]
    num_tokens: int


def cast_embeds(array: np.ndarray, dtype: str | None, *, param: str) -> Any:
    """``array`` in the engine's ``dtype`` (a numpy array, or a ``torch.bfloat16`` tensor);
    as it is when ``dtype`` is unknown or already its own. A 400 when the cast overflows."""
    if dtype is None or dtype not in CASTS or dtype == array.dtype.name:
        return array
    if dtype == "bfloat16":
        import torch

        return torch.from_numpy(np.ascontiguousarray(array)).to(torch.bfloat16)
    with np.errstate(over="ignore"):  # an overflow is the 400 below, not a warning
        cast = array.astype(dtype)
    if not np.isfinite(cast).all():
        raise InvalidRequestError(
            f"image_embeds has values beyond the range of {dtype}, this model's dtype",
            param=param,
        )
    return cast


def decode_embeds(
    b64: str,
    grid_thw: Sequence[int] | None,
    *,
    max_bytes: int,
    merge_size: int | None,
    param: str,
    hidden_size: int | None = None,
    dtype: str | None = None,
) -> tuple[bytes, PrecomputedEmbeds]:
    """An ``image_embeds`` part's .npy bytes and content (see the module's invariants). With
    ``grid_thw`` (Qwen2-VL) and the processor's ``merge_size``, its rows must be the grid's
    token count; with ``hidden_size`` (the language model's), its columns must be that; with
    ``dtype`` (the engine's), the array is cast to it."""
    if len(b64) > 4 * math.ceil(max_bytes / 3) + 4:
        raise InvalidRequestError(
            f"image_embeds is larger than the request body limit of {max_bytes} bytes",
            param=param,
        )
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequestError(f"image_embeds is not base64: {exc}", param=param) from exc
    stream = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, header_dtype = np.lib.format.read_array_header_1_0(stream)
        else:
            shape, fortran, header_dtype = np.lib.format.read_array_header_2_0(stream)
    except (ValueError, OSError) as exc:
        raise InvalidRequestError(
            f"image_embeds is not a .npy file (numpy.save of one array): {exc}", param=param
        ) from exc
    if header_dtype.hasobject or header_dtype.name not in EMBEDS_DTYPES:
        raise InvalidRequestError(
            f"image_embeds has dtype {header_dtype}; expected one of {', '.join(EMBEDS_DTYPES)}",
            param=param,
        )
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise InvalidRequestError(
            f"image_embeds has shape {tuple(shape)}; expected [tokens, hidden] (2-D, not empty)",
            param=param,
        )
    if hidden_size is not None and shape[1] != hidden_size:
        raise InvalidRequestError(
            f"image_embeds has {shape[1]} columns; this model's hidden size is {hidden_size}",
            param=param,
        )
    nbytes = int(shape[0]) * int(shape[1]) * header_dtype.itemsize
    if nbytes > max_bytes or nbytes != len(raw) - stream.tell():
        raise InvalidRequestError(
            f"image_embeds' shape {tuple(shape)} ({nbytes} bytes) does not match its "
            f"{len(raw) - stream.tell()} data bytes or exceeds {max_bytes} bytes",
            param=param,
        )
    array = np.load(io.BytesIO(raw), allow_pickle=False)
    if fortran:
        array = np.ascontiguousarray(array)
    if not np.isfinite(array).all():
        raise InvalidRequestError("image_embeds has non-finite values", param=param)
    tensors: dict[str, Any] = {MM_EMBEDS: cast_embeds(array, dtype, param=param)}
    if grid_thw is not None:
        grid = [int(v) for v in grid_thw]
        if len(grid) != 3 or min(grid) < 1:
            raise InvalidRequestError(
                f"image_grid_thw must be three positive integers [t, h, w], got {grid}",
                param=param,
            )
        if merge_size and grid[0] * grid[1] * grid[2] // merge_size**2 != shape[0]:
            raise InvalidRequestError(
                f"image_embeds has {shape[0]} rows but image_grid_thw {grid} makes "
                f"{grid[0] * grid[1] * grid[2] // merge_size**2} tokens",
                param=param,
            )
        tensors["image_grid_thw"] = np.asarray([grid], dtype=np.int64)
    return raw, PrecomputedEmbeds(tensors, int(shape[0]))
