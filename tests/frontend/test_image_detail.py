"""``image_url.detail``: ``low`` renders at the processor's minimum pixel budget.

With the real tiny processors (``mmis/frontend/client/processor.py`` states the rule): a Qwen2-VL
processor with the hub's budget (min 3136 pixels) gives a 1920x1080 photo a handful of
placeholder tokens instead of ~2.7k; a LLaVA processor (fixed input size) renders it the same
way whatever the detail; the two renderings of one image are two cache items (two mm_hashes,
two placeholder lengths), each exactly what the model's own processor makes with those kwargs.
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image
from transformers import AutoProcessor

from mmis.frontend.client.renderer import ImageRef
from mmis.frontend.state import FrontendState, load_processor
from mmis.telemetry.tracing import setup_tracing
from mmis.telemetry.tracing_config import TracingConfig
from mmis.tiny_models.tiny_model import tiny_model_dir

from .test_processor_kwargs import settings_for

pytestmark = pytest.mark.model


def photo(width: int = 1920, height: int = 1080) -> Image.Image:
    rng = np.random.default_rng(7)
    coarse = rng.integers(0, 255, (height // 64 + 1, width // 64 + 1, 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR)


def data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_low_pins_a_pixel_budget_to_its_minimum() -> None:
    model = tiny_model_dir("qwen2-vl-hub")
    processor, _ = load_processor(settings_for(model))
    low = processor.image_kwargs("low")
    assert low == {"size": {"shortest_edge": 3136, "longest_edge": 3136}}
    assert processor.image_kwargs("high") == processor.image_kwargs(None) == {}
    full, small = processor.process_image(photo()), processor.process_image(photo(), low)
    assert full.num_tokens > 2048 and small.num_tokens <= 4
    expected = AutoProcessor.from_pretrained(str(model))(
        text=[processor.image_token], images=[photo()], return_tensors="np", **low
    )
    np.testing.assert_array_equal(small.tensors["pixel_values"], expected["pixel_values"])

    # --processor-kwargs moves the minimum: low follows it
    size = {"shortest_edge": 4 * 3136, "longest_edge": 200_000}
    tuned, _ = load_processor(settings_for(model, "--processor-kwargs", json.dumps({"size": size})))
    pinned = {"shortest_edge": 4 * 3136, "longest_edge": 4 * 3136}
    assert tuned.image_kwargs("low") == {"size": pinned}
    assert tuned.process_image(photo(), tuned.image_kwargs("low")).num_tokens > small.num_tokens


def test_a_fixed_size_processor_has_one_rendering() -> None:
    processor, _ = load_processor(settings_for(tiny_model_dir("llava")))
    assert processor.image_kwargs("low") == processor.image_kwargs(None) == {}


async def test_two_details_of_one_image_are_two_cache_items() -> None:
    settings = settings_for(tiny_model_dir("qwen2-vl-hub"))
    processor, max_len = load_processor(settings)
    state = FrontendState(
        settings, processor, max_model_len=max_len, tracing=setup_tracing(TracingConfig())
    )
    try:
        url = data_url(photo())
        text = processor.chat_prompt(
            [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}]
        )
        refs = [ImageRef(url, None, "a", "low"), ImageRef(url, None, "b", "auto")]
        source = await state.renderer.prepare(text, refs)
        low, auto = source.items
        assert low.mm_hash != auto.mm_hash
        rendered = state.renderer.render_sync(source, False, 1)
        lengths = [f.placeholder.length for f in rendered.features[0]]
        assert lengths[0] <= 4 < 2048 < lengths[1]
    finally:
        await state.close()
