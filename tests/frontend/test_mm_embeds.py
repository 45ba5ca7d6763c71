"""``frontend/client/mm_embeds.py``'s cast to the engine's dtype, alone (the served path, a
bfloat16 engine given float32 embeddings, is ``tests/e2e/test_mm_embeds.py``'s)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from mmis.frontend.client.mm_embeds import decode_embeds
from mmis.frontend.errors import InvalidRequestError
from mmis.protocol.encoder import MM_EMBEDS


def _b64(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def _decode(array: np.ndarray, dtype: str | None) -> object:
    _, embeds = decode_embeds(
        _b64(array), None, max_bytes=1 << 20, merge_size=None, param="p", dtype=dtype
    )
    return embeds.tensors[MM_EMBEDS]


def test_float32_embeds_are_cast_to_the_engines_dtype() -> None:
    array = np.linspace(-2, 2, 24, dtype=np.float32).reshape(4, 6)
    out = _decode(array, "bfloat16")
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    assert torch.equal(out, torch.from_numpy(array).to(torch.bfloat16))
    half = _decode(array, "float16")
    assert isinstance(half, np.ndarray) and half.dtype == np.float16
    assert _decode(array.astype(np.float16), "float32").dtype == np.float32  # type: ignore[attr-defined]
    assert _decode(array, None) is not None and _decode(array, "int8").dtype == np.float32  # type: ignore[attr-defined]


def test_values_beyond_the_engines_dtype_are_a_400_naming_it() -> None:
    with pytest.raises(InvalidRequestError, match="beyond the range of float16"):
        _decode(np.full((2, 3), 1e6, np.float32), "float16")
