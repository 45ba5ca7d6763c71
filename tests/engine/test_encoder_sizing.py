"""The encoder cache is sized from the model's own image processor
(``engine/execution/encoder_sizing.py``).

Real processors, real adapters: a fixed-size processor (the tiny LLaVA's CLIP) gives its one
count cheaply; a Qwen2-VL processor with the hub's real pixel limits gives the count of the
largest image it accepts, which no photo exceeds; the flag and the floor behave as documented.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from mmis.engine.config import MIN_ENCODER_CACHE_TOKENS
from mmis.engine.execution.encoder_sizing import (
    encoder_cache_tokens,
    largest_item_tokens,
    load_image_processor,
)
from mmis.engine.execution.model import load_adapter

pytestmark = [pytest.mark.model]

REAL_QWEN2_VL_LIMITS = {"shortest_edge": 3136, "longest_edge": 12845056}  # min/max pixels


def _count(adapter, processor, size: tuple[int, int]) -> int:  # type: ignore[no-untyped-def]
    batch = processor(images=[Image.new("RGB", size, (90, 30, 200))], return_tensors="np")
    (item,) = adapter.split_processor_output(dict(batch))
    return int(adapter.num_placeholder_tokens(item))


def test_a_fixed_size_processor_is_measured_cheaply(tiny_dirs: dict[str, Path]) -> None:
    path = str(tiny_dirs["llava"])
    adapter = load_adapter(path, device="cpu")
    processor = load_image_processor(path, None)
    largest = largest_item_tokens(adapter, processor)
    assert largest == _count(adapter, processor, (1920, 1080)) == _count(adapter, processor, (7, 5))
    assert encoder_cache_tokens(None, largest) == MIN_ENCODER_CACHE_TOKENS  # the floor
    assert encoder_cache_tokens(64, largest) == 64  # --encoder-cache-tokens wins


def test_real_pixel_limits_size_the_cache_for_the_largest_photo(
    tiny_dirs: dict[str, Path],
) -> None:
    path = str(tiny_dirs["qwen2-vl"])
    adapter = load_adapter(path, device="cpu")
    processor = load_image_processor(path, None)
    processor.size = dict(REAL_QWEN2_VL_LIMITS)
    largest = largest_item_tokens(adapter, processor)
    assert largest is not None
    photos = [(640, 480), (1920, 1080), (4032, 3024), (3024, 4032)]
    counts = [_count(adapter, processor, size) for size in photos]
    assert counts[0] < counts[1] < counts[2]  # more pixels, more tokens, up to the limit
    assert max(counts) <= largest  # every photo fits the cache sized at start-up
    patch = processor.patch_size * processor.merge_size
    assert largest <= REAL_QWEN2_VL_LIMITS["longest_edge"] // patch**2  # the processor's limit
    assert encoder_cache_tokens(None, largest) == max(MIN_ENCODER_CACHE_TOKENS, largest)


def test_a_processor_that_cannot_be_probed_leaves_the_floor(tiny_dirs: dict[str, Path]) -> None:
    adapter = load_adapter(str(tiny_dirs["llava"]), device="cpu")

    def broken(**_: object) -> None:
        raise ValueError("no images today")

    assert largest_item_tokens(adapter, broken) is None
    assert encoder_cache_tokens(None, None) == MIN_ENCODER_CACHE_TOKENS
