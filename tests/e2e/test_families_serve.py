"""Each newer model family behind ``mmis serve``, asked through the openai SDK.

For every family whose P0 path differs from LLaVA's and Qwen2-VL's (Gemma 3: the template's
``<start_of_image>`` marker becomes ``\\n\\n<start_of_image>`` + soft tokens +
``<end_of_image>\\n\\n``, ``frontend/client/processor.py``; LLaVA-NeXT / OneVision: the placeholder
count depends on the photo's size), a chat request with two photos of different sizes is
answered with 200, its prompt token count is exactly the length of the model processor's own
``input_ids``, and its greedy text equals plain transformers ``generate()`` on the same decoded
images and prompt.
"""

from __future__ import annotations

import base64
import io
import sys
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from photos import jpeg as _jpeg
from procs import Proc, openai_client

from mmis.tiny_models.tiny_model import tiny_model_dir

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(600)]

FAMILIES = ("gemma3", "llava-onevision")
PROMPT = "Compare the two pictures."
MAX_TOKENS = 8
SIZES = ((640, 480), (300, 500))


@pytest.fixture(scope="module", params=FAMILIES)
def served(
    request: pytest.FixtureRequest, family_serve: Callable[[str], Proc]
) -> tuple[openai.OpenAI, Path]:
    proc = family_serve(request.param)  # the session's server of the family (conftest.py)
    return openai_client(proc, timeout=300), tiny_model_dir(request.param)


def _reference(model: Path, jpegs: list[bytes]) -> tuple[str, int]:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model)
    hf = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()
    images = [Image.open(io.BytesIO(j)).convert("RGB") for j in jpegs]
    parts: list[dict[str, str]] = [{"type": "image"} for _ in images]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": PROMPT}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=images, return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=[])
    length = int(inputs["input_ids"].shape[1])
    return str(processor.tokenizer.decode(out[0, length:].tolist(), skip_special_tokens=True)), (
        length
    )


def test_two_photos_are_answered_as_transformers_answers(
    served: tuple[openai.OpenAI, Path],
) -> None:
    client, model = served
    jpegs = [_jpeg(w, h) for w, h in SIZES]
    parts = [
        {
            "type": "image_url",
            "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(j).decode()},
        }
        for j in jpegs
    ]
    out = client.chat.completions.create(
        model="m",
        max_tokens=MAX_TOKENS,
        temperature=0,
        messages=[{"role": "user", "content": [*parts, {"type": "text", "text": PROMPT}]}],  # type: ignore[list-item]
        extra_body={"ignore_eos": True},
    )
    expected, prompt_tokens = _reference(model, jpegs)
    assert out.usage is not None
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.choices[0].message.content == expected
