"""Precomputed image embeddings as input (issue 46 item 4, ``--enable-mm-embeds``), end to end.

A real ``mmis serve`` on the tiny LLaVA, the openai SDK. Without the flag (the session's
shared ``tiny_serve``, the plain pixel path) an ``image_embeds`` part is a 400 naming the flag;
with it (``embeds_serve``, a **bfloat16** engine: users send float32 .npy files, which P0
casts to the engine's dtype as vLLM does), the float32 embeddings the test computes with the
model's own adapter from the processor's tensors of an image give the same greedy output as
that image sent as pixels, and a malformed part is a 400 naming its problem. (E/PD through a real
``mmis encoder`` is ``test_epd_e2e.py``'s.)"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image
from procs import Proc, ServeFactory, openai_client

from mmis.frontend.client.processor import ModelProcessor
from mmis.tiny_models.tiny_model import tiny_model_dir

ONE_THREAD = {"OMP_NUM_THREADS": "1"}
PROMPT = "What is in the picture?"


@pytest.fixture(scope="module")
def embeds_serve(start_serve: ServeFactory) -> Iterator[Proc]:
    flags = ("--model", str(tiny_model_dir()), "--served-model-name", "tiny")
    flags += ("--enable-mm-embeds", "--dtype", "bfloat16")
    with start_serve("serve-mm-embeds", *flags, env=ONE_THREAD) as proc:
        yield proc


def picture() -> Image.Image:
    image = Image.new("RGB", (48, 40), (200, 40, 90))
    image.paste((20, 180, 60), (0, 0, 24, 20))
    return image


def png_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def npy_b64(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def lying_header() -> str:
    """A .npy whose header claims 16 GiB of float32 over 32 bytes of data."""
    buf = io.BytesIO()
    header = {"descr": "<f4", "fortran_order": False, "shape": (1 << 26, 64)}
    np.lib.format.write_array_header_1_0(buf, header)
    buf.write(bytes(32))
    return base64.b64encode(buf.getvalue()).decode()


def embeds_of(image: Image.Image) -> np.ndarray:
    """The tiny LLaVA's encoder output for ``image`` as a float32 array: its adapter, in
    bfloat16 like ``embeds_serve``'s engine, on the processor tensors P0 would send (so the
    cast back to bfloat16 is exact), on one thread like the engine."""
    import torch

    from mmis.engine.execution.model import load_adapter

    processor = ModelProcessor.from_pretrained(str(tiny_model_dir()))
    tensors = processor.process_image(image).tensors
    adapter = load_adapter(tiny_model_dir(), "cpu", torch.bfloat16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            (out,) = adapter.encode_images([tensors])
    finally:
        torch.set_num_threads(threads)
    return out.float().numpy()


def ask(client: openai.OpenAI, part: dict[str, Any]) -> str:
    reply = client.chat.completions.create(
        model="tiny",
        max_tokens=8,
        temperature=0,
        messages=[
            {"role": "user", "content": [part, {"type": "text", "text": PROMPT}]}  # type: ignore[list-item,misc]
        ],
    )
    return reply.choices[0].message.content or ""


def test_image_embeds_without_the_flag_is_a_400_naming_it(tiny_serve: Proc) -> None:
    part = {"type": "image_embeds", "image_embeds": npy_b64(np.zeros((4, 8), np.float32))}
    with pytest.raises(openai.BadRequestError) as err:
        ask(openai_client(tiny_serve), part)
    assert "--enable-mm-embeds" in str(err.value)
    assert isinstance(err.value.body, dict)
    assert err.value.body.get("param") == "messages[0].content[0]", err.value.body


def test_image_embeds_give_the_pixel_paths_output(embeds_serve: Proc) -> None:
    """float32 embeddings on a bfloat16 engine: served (cast by P0), not a 503."""
    image = picture()
    pixels = ask(
        openai_client(embeds_serve), {"type": "image_url", "image_url": {"url": png_url(image)}}
    )
    embeds = embeds_of(image)
    assert embeds.dtype == np.float32
    part = {"type": "image_embeds", "image_embeds": npy_b64(embeds)}
    assert ask(openai_client(embeds_serve), part) == pixels
    assert pixels  # the tiny model says something: the comparison compares text


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        ("not base64!", "not base64"),
        (base64.b64encode(b"plain bytes").decode(), "not a .npy file"),
        (npy_b64(np.zeros((2, 3, 4), np.float32)), "expected [tokens, hidden]"),
        (npy_b64(np.zeros((4, 8), np.int32)), "dtype int32"),
        (npy_b64(np.full((4, 64), np.nan, np.float32)), "non-finite"),
        (npy_b64(np.zeros((4, 7), np.float32)), "this model's hidden size is"),
        (lying_header(), "does not match its 32 data bytes"),
    ],
)
def test_a_malformed_image_embeds_part_is_a_400_naming_the_problem(
    embeds_serve: Proc, payload: str, problem: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        ask(openai_client(embeds_serve), {"type": "image_embeds", "image_embeds": payload})
    assert problem in str(err.value)
