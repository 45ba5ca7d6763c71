"""``mmis/frontend/client/fast_image.py``: a PIL image reaches the resize as a channels-first
view, without transformers' full-size copy, and every output of the processor is bit-identical
to the unwrapped processor's, for every tiny model family and for odd sizes, RGBA, L, P-mode
and a photo-like 5 MP JPEG.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from transformers import AutoProcessor

from mmis.frontend.client import fast_image
from mmis.frontend.client.fast_image import install, is_installed
from mmis.frontend.client.processor import ModelProcessor
from mmis.tiny_models.tiny_model import FAMILIES, tiny_model_dir

pytestmark = pytest.mark.model


def _photo() -> Image.Image:
    """A 2448x2048 JPEG with smooth gradients and grain, reopened (mode RGB, like an upload)."""
    rng = np.random.default_rng(7)
    y, x = np.mgrid[0:2048, 0:2448].astype(np.float32)
    base = np.stack([x / 2448 * 255, y / 2048 * 255, (x + y) / 4496 * 255], axis=-1)
    grain = rng.normal(0, 12, base.shape)
    pixels = np.clip(base + grain, 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=88)
    buffer.seek(0)
    return Image.open(buffer)


@pytest.fixture(scope="module")
def images() -> dict[str, Image.Image]:
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (217, 333, 3), dtype=np.uint8)
    rgba = rng.integers(0, 256, (101, 59, 4), dtype=np.uint8)
    gray = rng.integers(0, 256, (75, 131), dtype=np.uint8)
    return {
        "rgb-odd": Image.fromarray(rgb),
        "rgba": Image.fromarray(rgba, mode="RGBA"),
        "l": Image.fromarray(gray, mode="L"),
        "p": Image.fromarray(rgb).convert("P"),
        "photo": _photo(),
    }


def _wrapped(image_processor: object) -> bool:
    return is_installed(image_processor)


@pytest.mark.parametrize("family", FAMILIES)
def test_same_outputs_with_and_without_the_wrapper(
    family: str, images: dict[str, Image.Image]
) -> None:
    model = str(tiny_model_dir(family))
    fast = ModelProcessor.from_pretrained(model)
    plain = AutoProcessor.from_pretrained(model)
    assert _wrapped(fast.processor.image_processor), "the pinned transformers is wrapped"
    assert not _wrapped(plain.image_processor)
    for name, image in images.items():
        view = fast.processor.image_processor.process_image(image, do_convert_rgb=True)
        assert not view.is_contiguous(), name  # the fast path ran: no channels-first copy
        got = fast.processor(text=[fast.image_token], images=[image], return_tensors="np")
        want = plain(text=[fast.image_token], images=[image], return_tensors="np")
        assert got.keys() == want.keys(), (family, name)
        for key in want:
            a, b = np.asarray(got[key]), np.asarray(want[key])
            assert a.dtype == b.dtype and a.shape == b.shape, (family, name, key)
            assert np.array_equal(a, b), (family, name, key)


def test_uncovered_inputs_take_the_original(images: dict[str, Image.Image]) -> None:
    """No conversion of an L image (2-D), a numpy input and a device: the original's tensor."""
    model = str(tiny_model_dir("llava"))
    fast = ModelProcessor.from_pretrained(model).processor.image_processor
    plain = AutoProcessor.from_pretrained(model).image_processor
    array = np.array(images["rgb-odd"])
    for image, kwargs in [
        (images["l"], {"do_convert_rgb": False}),
        (array, {"do_convert_rgb": True}),
        (images["rgb-odd"], {"do_convert_rgb": True, "device": "cpu"}),
    ]:
        a = fast.process_image(image, **kwargs)
        b = plain.process_image(image, **kwargs)
        assert a.is_contiguous() and a.dtype == b.dtype and bool((a == b).all())


def test_unchecked_transformers_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = AutoProcessor.from_pretrained(str(tiny_model_dir("llava"))).image_processor
    monkeypatch.setattr(fast_image, "_CHECKED", ("5.99.",))  # a release not checked
    assert install(plain) is False and not _wrapped(plain)


def test_the_wrapped_processor_still_serializes() -> None:
    """The instance's attributes are untouched: its config is the unwrapped one's."""
    model = str(tiny_model_dir("llava"))
    fast = ModelProcessor.from_pretrained(model).processor.image_processor
    plain = AutoProcessor.from_pretrained(model).image_processor
    assert fast.to_json_string() == plain.to_json_string()
