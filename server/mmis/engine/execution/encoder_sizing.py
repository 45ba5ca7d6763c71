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
- :func:`largest_item` keeps the probed item's tensors with its count: KV sizing encodes
  :func:`encoder_batch` copies of it in its profiling step (``engine/execution/kv_sizing.py``),
  the most encoder work one step may schedule.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
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


@dataclasses.dataclass(frozen=True)
class ProbedItem:
    """The largest image item the probe found: its placeholder count and processor tensors
    (what ``ModelAdapter.encode_images`` takes; it encodes to ``tokens`` embeddings)."""

    tokens: int
    data: Mapping[str, Any]


def largest_item(adapter: ModelAdapter, image_processor: Any) -> ProbedItem | None:
    """The item of the most placeholder tokens one image can take under the processor's
    limits (None: the processor could not be probed)."""
    try:
        if getattr(image_processor, "image_grid_pinpoints", None):
            return _largest_on_a_grid(adapter, image_processor)
        small = [_probe(adapter, image_processor, size) for size in SMALL_PROBES]
        if small[0].tokens == small[1].tokens:
            return small[1]
        probes = small + [_probe(adapter, image_processor, size) for size in PROBE_SIZES]
        return max(probes, key=lambda probe: probe.tokens)
    except Exception as exc:  # a processor we cannot probe: the floor still works
        log.warning("could not probe the image processor (%s): encoder cache at its floor", exc)
        return None


def largest_item_tokens(adapter: ModelAdapter, image_processor: Any) -> int | None:
    """The most placeholder tokens one image can take under the processor's limits."""
    item = largest_item(adapter, image_processor)
    return None if item is None else item.tokens


def encoder_batch(budget_tokens: int, item_tokens: int) -> int:
    """Copies of an item of ``item_tokens`` placeholders that one step may encode under the
    scheduler's per-step encoder budget (``encoder_compute_budget``, the encoder cache's
    size: :func:`encoder_cache_tokens`); 0 when one is beyond it (refused with a 400)."""
    return budget_tokens // item_tokens if item_tokens > 0 else 0


def _item(adapter: ModelAdapter, image_processor: Any, size: tuple[int, int]) -> Any:
    from PIL import Image

    width, height = size
    image = Image.fromarray(np.full((height, width, 3), 128, dtype=np.uint8))
    batch = image_processor(images=[image], return_tensors="np")
    (item,) = adapter.split_processor_output(dict(batch))
    return item


def _probe(adapter: ModelAdapter, image_processor: Any, size: tuple[int, int]) -> ProbedItem:
    item = _item(adapter, image_processor, size)
    return ProbedItem(int(adapter.num_placeholder_tokens(item)), item)


def _largest_on_a_grid(adapter: ModelAdapter, image_processor: Any) -> ProbedItem:
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
    largest = ProbedItem(int(adapter.num_placeholder_tokens(item)), item)
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
        tokens = int(adapter.num_placeholder_tokens(swept))
        if tokens > largest.tokens:
            largest = ProbedItem(tokens, swept)
    return largest


def encoder_cache_tokens(configured: int | None, largest: int | None) -> int:
    """``--encoder-cache-tokens`` if set, else the largest item, at least the floor."""
    if configured is not None:
        return configured
    return max(MIN_ENCODER_CACHE_TOKENS, largest or 0)
