"""A bfloat16 encoder output (E/PD on a GPU model, ``protocol/encoder.py``) through the SHM
payload format: numpy has no bfloat16, so ``shm/payload.py`` stores its raw 16 bits under the
dtype name ``bfloat16`` and reads a ``torch.bfloat16`` tensor back, bit for bit."""

from __future__ import annotations

import mmap

import msgspec
import numpy as np
import pytest
import torch

from mmis.shm import payload
from mmis.shm.errors import ShmPayloadError


def _round_trip(data: dict[str, object], copy: bool) -> dict[str, object]:
    p = payload.plan(data)
    buf = mmap.mmap(-1, p.size)
    payload.write(buf, 0, p)
    return payload.read(buf, 0, p.size, copy=copy)


@pytest.mark.parametrize("copy", [False, True])
def test_bfloat16_comes_back_bit_for_bit_beside_numpy_arrays(copy: bool) -> None:
    embeds = torch.randn(7, 5).to(torch.bfloat16)
    grid = np.array([[1, 4, 6]], dtype=np.int64)
    out = _round_trip({"mm_embeds": embeds, "image_grid_thw": grid}, copy)
    got = out["mm_embeds"]
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), embeds.view(torch.int16))
    np.testing.assert_array_equal(out["image_grid_thw"], grid)


def test_a_bfloat16_entry_of_the_wrong_size_is_corrupt() -> None:
    p = payload.plan({"mm_embeds": torch.zeros(4, 4, dtype=torch.bfloat16)})
    entries = msgspec.msgpack.decode(p.header)
    entries[0][2] = [4, 5]  # the shape no longer matches the 32 bytes stored
    bad = payload.Plan(msgspec.msgpack.encode(entries), p.arrays, p.size + 64)
    buf = mmap.mmap(-1, bad.size)
    payload.write(buf, 0, bad)
    with pytest.raises(ShmPayloadError, match="corrupt"):
        payload.read(buf, 0, bad.size, copy=False)
