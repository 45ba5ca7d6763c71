"""Real photo sizes on a Qwen2-VL with the hub's image settings, served with no tuning flags.

The tiny ``qwen2-vl-hub`` model (``mmis/tiny_models/tiny_model.py``: patch 14, merge 2,
min_pixels 3136, max_pixels 12845056, a 32768-token context) behind ``mmis serve --model
DIR``: 640x480 and 1920x1080 JPEG photos are answered with 200 through the openai SDK,
and the 1920x1080 answer equals plain transformers' greedy ``generate()`` on the same
decoded image and prompt; the same photo with ``detail: "low"`` takes the processor's minimum
pixel budget (a handful of tokens). A 6.5 MP 2912x2240 photo (8320 placeholder tokens) is
answered too: more than one prefill chunk, so its range is split across chunks, and more than
the old fixed 8192-slot encoder cache (the floor, ``MIN_ENCODER_CACHE_TOKENS``), so it is
served only because the cache was sized from the processor at start-up. That this sizing
fits a 12 MP 4032x3024 photo (15552 tokens) and every image the processor accepts is
``tests/engine/test_encoder_sizing.py``'s check; served end to end, the 12 MP photo cost 88 s
here (its vision tower's attention grows with the square of its 62k patches), the 7 MP one
about a third of that.
"""

from __future__ import annotations

import base64
import io
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from photos import jpeg as _jpeg
from procs import ServeFactory, openai_client

from mmis.engine.config import MIN_ENCODER_CACHE_TOKENS
from mmis.tiny_models.tiny_model import tiny_model_dir

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = "What is in the picture?"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def served(start_serve: ServeFactory) -> Iterator[tuple[openai.OpenAI, Path]]:
    model = tiny_model_dir("qwen2-vl-hub")
    flags = ("--model", str(model), "--served-model-name", "q")
    with start_serve("serve-photos", *flags, ready_s=600) as proc:
        yield openai_client(proc, timeout=600), model


def _ask(client: openai.OpenAI, jpeg: bytes, detail: str | None = None) -> tuple[str, int, int]:
    url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    image_url = {"url": url} if detail is None else {"url": url, "detail": detail}
    out = client.chat.completions.create(
        model="q",
        max_tokens=MAX_TOKENS,
        temperature=0,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": image_url},
                    {"type": "text", "text": PROMPT},
                ],
            }
        ],
    )
    assert out.usage is not None
    return (
        out.choices[0].message.content or "",
        out.usage.prompt_tokens,
        out.usage.completion_tokens,
    )


def _reference(model: Path, jpeg: bytes) -> str:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model)
    hf = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()
    image = Image.open(io.BytesIO(jpeg)).convert("RGB")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    return str(processor.tokenizer.decode(new, skip_special_tokens=True))


def test_photos_are_answered_and_full_hd_matches_transformers(
    served: tuple[openai.OpenAI, Path],
) -> None:
    client, model = served
    small = _ask(client, _jpeg(640, 480))
    full_hd_jpeg = _jpeg(1920, 1080)
    full_hd = _ask(client, full_hd_jpeg)
    assert small[1] < full_hd[1]  # more pixels, more placeholder tokens
    assert full_hd[1] > 2048  # more than one prefill chunk (the default step: 512 on CPU)
    assert full_hd[0] == _reference(model, full_hd_jpeg)
    # detail "low": the processor's minimum pixel budget, a handful of placeholder tokens
    low = _ask(client, full_hd_jpeg, "low")
    assert low[1] < small[1] < full_hd[1]
    assert low[1] < 40


def test_a_photo_past_the_old_fixed_encoder_cache_is_answered(
    served: tuple[openai.OpenAI, Path],
) -> None:
    client, _ = served
    _, prompt_tokens, completion_tokens = _ask(client, _jpeg(2912, 2240))
    # past the old fixed encoder cache (the floor): served only from the processor's sizing
    assert prompt_tokens > MIN_ENCODER_CACHE_TOKENS == 8192
    assert completion_tokens >= 1
