"""Precomputed image embeddings as input (issue 46 item 4, ``--enable-mm-embeds``), end to end.

A real ``mmis serve`` on the tiny LLaVA, the openai SDK. Without the flag (the session's
shared ``tiny_serve``, the plain pixel path) an ``image_embeds`` part is a 400 naming the flag;
with it, the embeddings the test computes with the model's own adapter from the processor's
tensors of an image give the same greedy output as that image sent as pixels to
``tiny_serve``, and a malformed part is a 400 naming its problem.

The flagged server also asks a real ``mmis encoder`` (``--encoder-urls``, with a token): one
E/PD smoke test (an image's output equals the pixel path's, the encoder's output was used and
P1 refused none). The E/PD scenarios (kill, bad outputs, several PD engines) are elsewhere."""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image
from procs import Proc, ServeFactory, image_url, openai_client, series, wait_for

from mmis.frontend.client.processor import ModelProcessor
from mmis.tiny_models.tiny_model import tiny_model_dir

ONE_THREAD = {"OMP_NUM_THREADS": "1"}
PROMPT = "What is in the picture?"


TOKEN = {"MMIS_ENCODER_TOKEN": "mm-embeds-test"}
READY = re.compile(r"mmis encoder: ready on (tcp://\S+)")


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``mmis encoder`` on the tiny LLaVA (CPU, float32 as the tiny P1): its endpoint."""
    flags = ["--model", str(tiny_model_dir()), "--device", "cpu", "--dtype", "float32"]
    flags += ["--threads", "1", "--endpoint", "tcp://127.0.0.1:0", "--health-port", "0"]
    proc = Proc("encoder", ["encoder", *flags], tmp_path_factory.mktemp("encoder"), TOKEN)
    try:
        wait_for("the encoder's ready line", lambda: bool(READY.search(log(proc))), 120)
        found = READY.search(log(proc))
        assert found is not None
        yield found.group(1)
    finally:
        proc.stop()


def log(proc: Proc) -> str:
    if proc.popen.poll() is not None:
        raise RuntimeError(f"{proc.name} exited {proc.popen.returncode}\n{proc.log_tail()}")
    return proc.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def embeds_serve(start_serve: ServeFactory, encoder: str) -> Iterator[Proc]:
    flags = ("--model", str(tiny_model_dir()), "--served-model-name", "tiny")
    epd = ("--enable-mm-embeds", "--encoder-urls", encoder)
    with start_serve("serve-mm-embeds", *flags, *epd, env={**ONE_THREAD, **TOKEN}) as proc:
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
    """The tiny LLaVA's encoder output for ``image``: its adapter on the processor tensors P0
    would send (float32, as ``mmis serve`` runs the tiny model on CPU)."""
    import torch

    from mmis.engine.execution.model import load_adapter

    processor = ModelProcessor.from_pretrained(str(tiny_model_dir()))
    tensors = processor.process_image(image).tensors
    adapter = load_adapter(tiny_model_dir(), "cpu", torch.float32)
    with torch.inference_mode():
        (out,) = adapter.encode_images([tensors])
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


def test_image_embeds_give_the_pixel_paths_output(embeds_serve: Proc, tiny_serve: Proc) -> None:
    image = picture()
    pixels = ask(
        openai_client(tiny_serve), {"type": "image_url", "image_url": {"url": png_url(image)}}
    )
    embeds = embeds_of(image)
    part = {"type": "image_embeds", "image_embeds": npy_b64(embeds)}
    assert ask(openai_client(embeds_serve), part) == pixels
    assert pixels  # the tiny model says something: the comparison compares text


def test_an_image_through_the_encoder_gives_the_pixel_paths_output(
    embeds_serve: Proc, tiny_serve: Proc
) -> None:
    part = {"type": "image_url", "image_url": {"url": image_url((90, 160, 30))}}
    ok = series(embeds_serve, "mmis_encoder_requests_total", outcome="ok")
    assert ask(openai_client(embeds_serve), part) == ask(openai_client(tiny_serve), part)
    assert series(embeds_serve, "mmis_encoder_requests_total", outcome="ok") == ok + 1
    assert series(embeds_serve, "mmis_encoder_outputs_rejected_total") == 0


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
