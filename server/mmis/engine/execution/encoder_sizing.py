"""Sizing P1's encoder cache from the model's own image processor, once at start-up.

A photo's placeholder count depends on the processor's pixel limits (Qwen2-VL: up to
``max_pixels / (patch * merge)**2`` tokens; LLaVA: fixed; any-resolution families: tiles),
so a fixed cache refuses real photos. :func:`largest_item_tokens` *measures* instead of
computing per family: it runs the model's image processor (no tokenizer) on the largest
image a client may send (:data:`PROBE_SIZES`, past any processor's limit, so it is clamped
to that limit; skipped when :data:`SMALL_PROBES` show the output does not grow) and counts
its tokens with the model adapter's own ``num_placeholder_tokens``, the count the engine
checks every request against. An any-resolution processor (``image_grid_pinpoints``) runs
once, on its largest grid, and that item is counted again under swept ``image_sizes``
(:data:`GRID_SWEEP`): its largest count is at no single probe size.

Invariants:
- The encoder cache (and the per-step encoder budget) is at least the largest probed item
  and at least :data:`~mmis.engine.config.MIN_ENCODER_CACHE_TOKENS`; ``--encoder-cache-tokens``
  overrides it. An item beyond it is refused with a 400 naming that flag
  (``engine/scheduling/scheduler.py``).
- P1 uses the processor's defaults: P0's ``--processor-kwargs`` may raise a pixel limit, in
  which case the flag must be raised with it.
- A model without an image processor, or one that fails on the probe, is sized at the floor
  (logged), never refused at start-up for it.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from mmis.engine.config import MIN_ENCODER_CACHE_TOKENS

if TYPE_CHECKING:
    from mmis.engine.execution.model import ModelAdapter

log = logging.getLogger(__name__)

# a square thumbnail and a 1 MP square first: when they take as many tokens as each other,
# the processor's output does not grow past them (a fixed size, or a limit already reached)
# and the large probe is skipped; else a 25 MP square, the front end's default pixel limit
# (a square takes the most tokens under a pixel-count limit or a tile grid)
SMALL_PROBES = ((64, 64), (1024, 1024))
PROBE_SIZES = ((5000, 5000),)
# any-resolution grids: sizes swept per grid edge; 32 finds what a search of every size up to
# the largest grid finds, for the hub's LLaVA-NeXT and OneVision pinpoints (2928 and 8765
# tokens; a square probe gives OneVision 7371) and for the tiny models' (88 and 198)
GRID_SWEEP = 32


def load_image_processor(model: str, revision: str | None) -> Any | None:
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(model, revision=revision)
    except (OSError, ValueError, KeyError) as exc:
        log.warning("no image processor for %s (%s): encoder cache at its floor", model, exc)
        return None


def largest_item_tokens(adapter: ModelAdapter, image_processor: Any) -> int | None:
    """The most placeholder tokens one image can take under the processor's limits."""
    try:
        if getattr(image_processor, "image_grid_pinpoints", None):
            return _largest_on_a_grid(adapter, image_processor)
        small = [_tokens(adapter, image_processor, size) for size in SMALL_PROBES]
        if small[0] == small[1]:
            return small[1]
        return max(small + [_tokens(adapter, image_processor, size) for size in PROBE_SIZES])
    except Exception as exc:  # a processor we cannot probe: the floor still works
        log.warning("could not probe the image processor (%s): encoder cache at its floor", exc)
        return None


def _item(adapter: ModelAdapter, image_processor: Any, size: tuple[int, int]) -> Any:
    from PIL import Image

    width, height = size
    image = Image.fromarray(np.full((height, width, 3), 128, dtype=np.uint8))
    batch = image_processor(images=[image], return_tensors="np")
    (item,) = adapter.split_processor_output(dict(batch))
    return item


def _tokens(adapter: ModelAdapter, image_processor: Any, size: tuple[int, int]) -> int:
    return int(adapter.num_placeholder_tokens(_item(adapter, image_processor, size)))


def _largest_on_a_grid(adapter: ModelAdapter, image_processor: Any) -> int:
    """Any-resolution processors (``image_grid_pinpoints``: LLaVA-NeXT, OneVision).

    The count depends on the image only through its size (``image_sizes``) and the grid picked
    for it, and its maximum is not at a square (OneVision's ``anyres_max`` shrinking of large
    grids lets a smaller, oblong one give more). So the processor runs once, on an image of
    the largest grid (the most tiles), and that item is counted again with the sizes of
    :data:`GRID_SWEEP` steps along every grid's edges, at the grid's size and far past it.
    """
    pinpoints = [(int(h), int(w)) for h, w in image_processor.image_grid_pinpoints]
    height, width = max(pinpoints, key=lambda hw: hw[0] * hw[1])
    item = _item(adapter, image_processor, (width, height))
    largest = int(adapter.num_placeholder_tokens(item))
    sizes: set[tuple[int, int]] = set()
    for h, w in pinpoints:
        for step in range(1, GRID_SWEEP + 1):
            for size in (
                (h, math.ceil(w * step / GRID_SWEEP)),
                (math.ceil(h * step / GRID_SWEEP), w),
            ):
                sizes.update({size, (size[0] * 8, size[1] * 8)})
    for size in sorted(sizes):
        swept = {**item, "image_sizes": np.asarray([size], dtype=np.int64)}
        largest = max(largest, int(adapter.num_placeholder_tokens(swept)))
    return largest


def encoder_cache_tokens(configured: int | None, largest: int | None) -> int:
    """``--encoder-cache-tokens`` if set, else the largest item, at least the floor."""
    if configured is not None:
        return configured
    return max(MIN_ENCODER_CACHE_TOKENS, largest or 0)
