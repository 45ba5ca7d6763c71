"""Two front ends with different ``--processor-kwargs`` feeding ONE P1 (real P1 shell,
sockets and receiver cache; scripted core whose output is a function of the tensors it got).

The same image sent through both must become two receiver entries with each side's own
tensors, and later shadow hits (``data=None``) must be served from each side's own entry:
P1 never answers a request processed one way with an image processed the other way.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image

from mmis.entrypoints import frontend as frontend_cli
from mmis.frontend.client.processor import ModelProcessor
from mmis.tiny_models.tiny_model import tiny_model_dir

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine, RunningFrontend

KWARGS = {"do_normalize": False}  # tiny LLaVA: same shape, other pixel values


def png_url() -> tuple[str, Image.Image]:
    image = Image.new("RGB", (64, 48))
    image.putdata([((x * 4) % 256, (y * 5) % 256, 77) for y in range(48) for x in range(64)])
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(), image


def frontend(engine: FakeEngine, index: int, *flags: str) -> RunningFrontend:
    parser = argparse.ArgumentParser(exit_on_error=False)
    frontend_cli.add_arguments(parser)
    argv = ["--model", str(tiny_model_dir()), "--served-model-name", "tiny"]
    argv += ["--engine-input-address", engine.input_address]
    argv += ["--engine-output-address", engine.output_address]
    argv += ["--client-index", str(index), *flags]
    return RunningFrontend(frontend_cli.settings_from(parser.parse_args(argv)))


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[FakeEngine, RunningFrontend, RunningFrontend]]:
    mp = pytest.MonkeyPatch()
    for key in ("MMIS_FRONTEND_PROCESSOR_KWARGS", "MMIS_FRONTEND_REVISION"):
        mp.delenv(key, raising=False)
    engine = FakeEngine(str(tmp_path_factory.mktemp("p1"))).start()
    plain = frontend(engine, 0)
    tuned = frontend(engine, 1, "--processor-kwargs", json.dumps(KWARGS))
    try:
        plain.start()
        tuned.start()
        yield engine, plain, tuned
    finally:
        tuned.stop()
        plain.stop()
        engine.stop()
        mp.undo()


def ask(front: RunningFrontend, url: str) -> str:
    client = openai.OpenAI(base_url=front.base_url, api_key="x", timeout=30, max_retries=0)
    content: list[Any] = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is it?"},
    ]
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": content}],
        max_tokens=6,
        temperature=0,
    )
    return out.choices[0].message.content or ""


def test_one_image_two_kwargs_two_entries_each_served_its_own(
    stack: tuple[FakeEngine, RunningFrontend, RunningFrontend],
) -> None:
    engine, plain, tuned = stack
    url, image = png_url()
    known = set(engine.receiver.keys())  # the readiness probes' items

    first = {"plain": ask(plain, url), "tuned": ask(tuned, url)}
    now = engine.receiver.keys()  # a list, least recently used first
    added = [h for h in now if h not in known]
    assert len(added) == 2, f"one image under two kwargs must be two items, got {added}"

    # each entry holds what one of the two configured processors makes of the image
    stored = [engine.receiver.peek(h) for h in added]
    expected = [
        ModelProcessor.from_pretrained(str(tiny_model_dir()), kwargs).process_image(image)
        for kwargs in ({}, KWARGS)
    ]
    for tensors in stored:
        assert tensors is not None
        matches = [
            np.allclose(tensors["pixel_values"], e.tensors["pixel_values"], atol=1e-6)
            for e in expected
        ]
        assert matches.count(True) == 1
    assert first["plain"] != first["tuned"]  # P1 computed from different tensors

    # shadow hits now (data=None): each side is still served from its own entry
    hits_before = engine.receiver.hits
    again = {"plain": ask(plain, url), "tuned": ask(tuned, url)}
    assert engine.receiver.hits == hits_before + 2
    assert again == first
