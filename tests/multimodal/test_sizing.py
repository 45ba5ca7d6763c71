"""Item sizing: one function, identical results on both sides."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmis.multimodal.cache import TENSOR_OVERHEAD_BYTES, ItemSizeError, item_nbytes


def test_sum_of_nbytes_plus_overhead() -> None:
    item = {
        "pixel_values": np.zeros((3, 4, 4), dtype=np.float32),
        "image_grid_thw": np.zeros((1, 3), dtype=np.int64),
    }
    assert item_nbytes(item) == 3 * 4 * 4 * 4 + 3 * 8 + 2 * TENSOR_OVERHEAD_BYTES


def test_depends_on_shape_and_dtype_not_values_or_order() -> None:
    a = {"x": np.ones((2, 2), np.float16), "y": np.zeros(5, np.uint8)}
    b = {"y": np.full(5, 7, np.uint8), "x": np.zeros((2, 2), np.float16)}
    assert item_nbytes(a) == item_nbytes(b)
    assert item_nbytes({"x": np.zeros(4, np.float32)}) != item_nbytes(
        {"x": np.zeros(4, np.float64)}
    )


def test_numpy_and_torch_agree() -> None:
    arr = np.zeros((2, 3), np.float32)
    assert item_nbytes({"p": arr}) == item_nbytes({"p": torch.from_numpy(arr)})


def test_empty_tensor_still_costs_overhead() -> None:
    assert item_nbytes({"p": np.zeros(0, np.float32)}) == TENSOR_OVERHEAD_BYTES
    assert item_nbytes({}) == 0


def test_non_tensor_values_are_rejected() -> None:
    with pytest.raises(ItemSizeError, match="'label'"):
        item_nbytes({"label": "cat"})
    with pytest.raises(ItemSizeError, match="mapping"):
        item_nbytes([np.zeros(2)])  # type: ignore[arg-type]
