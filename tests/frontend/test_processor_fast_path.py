"""``ModelProcessor.process_image``'s fast path (``mmis/frontend/client/processor.py`` states
the rule): an image whose size, mode, kwargs and processed shapes were measured before runs the
image processor alone, and gets exactly the tensors and placeholder count of the processor's
full call; an image of a size not measured yet costs one full call and no more image
processing; a processor whose full call does more than its image processor keeps the full
call.

Real tiny processors with the hub's image settings (Qwen2-VL's pixel budget: the count
depends on the size), photos of several sizes, the default and the ``low`` renderings.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from PIL import Image

from mmis.frontend.client.processor import ModelProcessor, ProcessedImage
from mmis.tiny_models.tiny_model import tiny_model_dir

pytestmark = pytest.mark.model

SIZES = [(64, 64), (640, 480), (64, 64), (37, 100), (640, 480), (1280, 720), (64, 64)]


def pictures(seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for (w, h) in SIZES]


def same(a: ProcessedImage, b: ProcessedImage) -> bool:
    return (
        a.num_tokens == b.num_tokens
        and a.tensors.keys() == b.tensors.keys()
        and all(
            a.tensors[k].dtype == b.tensors[k].dtype and np.array_equal(a.tensors[k], b.tensors[k])
            for k in a.tensors
        )
    )


class CountingProcessor(ModelProcessor):
    def __init__(self, processor: Any) -> None:
        super().__init__(processor)
        self.full_calls = 0

    def process_image_fully(self, image: Any, kwargs: Any) -> ProcessedImage:
        self.full_calls += 1
        return super().process_image_fully(image, kwargs)


@pytest.mark.parametrize("family", ["llava", "qwen2-vl-hub"])
def test_fast_path_gives_the_full_calls_tensors_and_counts(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tuned = ModelProcessor.from_pretrained(str(tiny_model_dir(family)))
    processor = CountingProcessor(tuned.processor)
    reference = ModelProcessor.from_pretrained(str(tiny_model_dir(family)))
    image_processor = type(processor.processor.image_processor)
    runs = {"image processor": 0}
    plain_call = image_processor.__call__

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self is processor.processor.image_processor:
            runs["image processor"] += 1
        return plain_call(self, *args, **kwargs)

    monkeypatch.setattr(image_processor, "__call__", counted)
    low = processor.image_kwargs("low")
    renderings = [None] if low == processor.processor_kwargs else [None, low]  # LLaVA: one
    for kwargs in renderings:
        every = pictures(1) + pictures(2)  # the second set: same sizes, other pixels
        before, ran = processor.full_calls, runs["image processor"]
        for image in every:
            fast = processor.process_image(image, kwargs)
            full = reference.process_image_fully(image, kwargs or {})
            assert same(fast, full), (family, kwargs, image.size)
        # the full call ran once per distinct size; every other image ran the fast path
        assert processor.full_calls - before == len(set(SIZES))
        # one image processor run per image (in the full call or alone), plus one check
        assert runs["image processor"] - ran == len(every) + 1
    counts = {image.size: processor.process_image(image).num_tokens for image in pictures(3)}
    if family == "qwen2-vl-hub":  # a pixel budget: the count follows the size
        assert counts[(1280, 720)] > counts[(640, 480)] > counts[(64, 64)]


class Doubling:
    """A processor whose full call changes the image processor's pixels (as a processor that
    applies its own defaults would): the fast path must never be taken."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.image_token = inner.image_token
        self.tokenizer = inner.tokenizer
        self.image_processor = inner.image_processor

    def __call__(self, **kwargs: Any) -> Any:
        out = self.inner(**kwargs)
        out["pixel_values"] = out["pixel_values"] * 2
        return out


def test_a_full_call_that_disagrees_keeps_the_full_call() -> None:
    inner = ModelProcessor.from_pretrained(str(tiny_model_dir("llava"))).processor
    processor = CountingProcessor(Doubling(inner))
    images = pictures(4)
    for image in images:
        got = processor.process_image(image)
        alone = inner.image_processor(images=[image], return_tensors="np")["pixel_values"]
        np.testing.assert_array_equal(got.tensors["pixel_values"], alone * 2)
    assert processor.full_calls == len(images)
