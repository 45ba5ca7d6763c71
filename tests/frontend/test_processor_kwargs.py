"""``--processor-kwargs`` with the real tiny processors: the flag reaches the processor call
(what P1 receives changes) and every content mm_hash (an image processed one way never shares
a hash with the same image processed another way).

Settings are built the way ``mmis frontend`` builds them (its parser, ``settings_from``), the
processor is loaded by ``load_processor`` and the renderer is the one ``FrontendState`` wires.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from transformers import AutoProcessor

from mmis.entrypoints import frontend as frontend_cli
from mmis.frontend.client.renderer import SourceItem, SourcePrompt
from mmis.frontend.config import FrontendConfig
from mmis.frontend.state import FrontendState, load_processor
from mmis.telemetry.tracing import Tracing, setup_tracing
from mmis.telemetry.tracing_config import TracingConfig
from mmis.tiny_models.tiny_model import tiny_model_dir

# per tiny family, kwargs that really change the processor's output
KWARGS: dict[str, dict[str, Any]] = {
    "llava": {"do_normalize": False},  # same shape, other pixel values
    "qwen2-vl": {"size": {"shortest_edge": 3136, "longest_edge": 12544}},  # more patches
}


def picture() -> Image.Image:
    image = Image.new("RGB", (320, 240))
    image.putdata(
        [((x * 3) % 256, (y * 5) % 256, (x + y) % 256) for y in range(240) for x in range(320)]
    )
    return image


def settings_for(model: Path, *flags: str) -> FrontendConfig:
    parser = argparse.ArgumentParser(exit_on_error=False)
    frontend_cli.add_arguments(parser)
    settings = frontend_cli.settings_from(parser.parse_args(["--model", str(model), *flags]))
    return settings


def kwargs_flag(family: str) -> tuple[str, str]:
    return "--processor-kwargs", json.dumps(KWARGS[family])


@pytest.fixture(autouse=True)
def _no_server_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("MMIS_FRONTEND_PROCESSOR_KWARGS", "MMIS_FRONTEND_REVISION"):
        monkeypatch.delenv(key, raising=False)


@pytest.fixture(scope="module")
def tracing() -> Tracing:
    return setup_tracing(TracingConfig())  # no endpoint: off


@pytest.fixture
async def make_state(tracing: Tracing) -> AsyncIterator[Callable[[FrontendConfig], FrontendState]]:
    """A FrontendState as ``create`` builds it, minus the engine connection (never started)."""
    states: list[FrontendState] = []

    def make(settings: FrontendConfig) -> FrontendState:
        processor, max_len = load_processor(settings)
        state = FrontendState(settings, processor, max_model_len=max_len, tracing=tracing)
        states.append(state)
        return state

    yield make
    for state in states:
        await state.close()


@pytest.mark.parametrize("family", sorted(KWARGS))
def test_the_flag_changes_what_the_processor_produces(family: str) -> None:
    model = tiny_model_dir(family)
    plain, _ = load_processor(settings_for(model))
    tuned, _ = load_processor(settings_for(model, *kwargs_flag(family)))
    assert plain.processor_kwargs == {}
    assert tuned.processor_kwargs == KWARGS[family]

    before, after = plain.process_image(picture()), tuned.process_image(picture())
    assert before.tensors.keys() == after.tensors.keys()
    changed = [
        name
        for name in before.tensors
        if before.tensors[name].shape != after.tensors[name].shape
        or not np.array_equal(before.tensors[name], after.tensors[name])
    ]
    assert "pixel_values" in changed
    if family == "qwen2-vl":  # a larger size bound: more patches, more placeholder tokens
        assert after.num_tokens > before.num_tokens

    # exactly what the model's own processor makes when called with those kwargs
    raw = AutoProcessor.from_pretrained(str(model))
    expected = raw(
        text=[tuned.image_token], images=[picture()], return_tensors="np", **KWARGS[family]
    )
    np.testing.assert_array_equal(after.tensors["pixel_values"], expected["pixel_values"])


@pytest.mark.parametrize("family", sorted(KWARGS))
async def test_the_same_image_under_two_kwargs_has_two_hashes(
    family: str, make_state: Callable[[FrontendConfig], FrontendState]
) -> None:
    model = tiny_model_dir(family)
    plain = make_state(settings_for(model))
    tuned = make_state(settings_for(model, *kwargs_flag(family)))
    reordered = dict(reversed(list(KWARGS[family].items())))
    again = make_state(settings_for(model, "--processor-kwargs", json.dumps(reordered)))

    hashes = [state.renderer.hash_image(picture(), None) for state in (plain, tuned, again)]
    assert hashes[0] != hashes[1]
    assert hashes[1] == hashes[2]  # the same kwargs (in any key order): the same item
    # another revision is another model (a local directory ignores it, the hash does not)
    pinned = make_state(settings_for(model, "--revision", "v2"))
    assert pinned.renderer.hash_image(picture(), None) not in hashes

    # what each front end would send P1: its own hash with its own tensors
    sent = {}
    for state, mm_hash in zip((plain, tuned), hashes, strict=False):
        image = picture()
        text = state.processor.chat_prompt(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
        )
        source = SourcePrompt(
            state.processor.tokenize(text), [SourceItem(mm_hash, None, image, "p")]
        )
        rendered = state.renderer.render_sync(source, False, 1)
        (feature,) = rendered.features[0]
        assert feature.mm_hash == mm_hash and isinstance(feature.data, dict)
        sent[mm_hash] = feature.data
    processors = (plain.processor, tuned.processor)
    for processor, mm_hash in zip(processors, hashes, strict=False):
        expected = processor.process_image(picture()).tensors
        np.testing.assert_array_equal(sent[mm_hash]["pixel_values"], expected["pixel_values"])
