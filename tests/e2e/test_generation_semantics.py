"""The model's own generation semantics, through ``mmis serve`` and the openai SDK.

- Every end-of-sequence id of the checkpoint stops a request: a Qwen2-VL whose
  ``generation_config`` lists ``<|im_end|>`` and ``<|endoftext|>`` (as the hub's does) stops
  at ``<|endoftext|>`` on a request without ``max_tokens`` (``logit_bias`` makes the tiny
  random model pick it).
- The generation config's sampling values are the defaults of requests that omit them
  (``frontend/api/generation_defaults.py``): with ``temperature: 0`` and ``max_new_tokens: 5``
  there, two requests with different seeds give the same five tokens; what a request sets
  wins.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from procs import ServeFactory, openai_client

from mmis.tiny_models.tiny_model import tiny_model_dir

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(600)]


def _variant(family: str, dst: Path, **generation: object) -> Path:
    shutil.copytree(tiny_model_dir(family), dst)
    path = dst / "generation_config.json"
    config = json.loads(path.read_text())
    config.update(generation)
    path.write_text(json.dumps(config))
    return dst


def _serve(start_serve: ServeFactory, name: str, model: Path) -> Iterator[openai.OpenAI]:
    with start_serve(name, "--model", str(model), "--served-model-name", "m") as proc:
        yield openai_client(proc)


@pytest.fixture(scope="module")
def qwen(
    tmp_path_factory: pytest.TempPathFactory, start_serve: ServeFactory
) -> Iterator[tuple[openai.OpenAI, int]]:
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("qwen-eos")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("qwen2-vl"))
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model = _variant("qwen2-vl", tmp / "model", eos_token_id=[im_end, endoftext])
    config = json.loads((model / "config.json").read_text())
    assert config["text_config"]["eos_token_id"] == im_end  # the config names only one
    yield from ((client, endoftext) for client in _serve(start_serve, "serve-qwen-eos", model))


@pytest.fixture(scope="module")
def greedy_llava(
    tmp_path_factory: pytest.TempPathFactory, start_serve: ServeFactory
) -> Iterator[openai.OpenAI]:
    tmp = tmp_path_factory.mktemp("llava-defaults")
    model = _variant("llava", tmp / "model", temperature=0.0, max_new_tokens=5)
    yield from _serve(start_serve, "serve-llava-defaults", model)


def test_every_eos_id_stops_a_request_without_max_tokens(qwen: tuple[openai.OpenAI, int]) -> None:
    client, endoftext = qwen
    out = client.completions.create(
        model="m", prompt="Hello there", logit_bias={str(endoftext): 100}
    )
    (choice,) = out.choices
    assert choice.finish_reason == "stop"
    assert out.usage is not None and out.usage.completion_tokens == 1


def test_generation_config_values_are_the_request_defaults(greedy_llava: openai.OpenAI) -> None:
    def complete(**kw: object) -> tuple[str, int]:
        out = greedy_llava.completions.create(
            model="m", prompt="Hello there", extra_body={"ignore_eos": True}, **kw
        )
        assert out.usage is not None
        return out.choices[0].text, out.usage.completion_tokens

    # temperature 0 and max_new_tokens 5 from the generation config: seeds do not matter
    first, second = complete(seed=1), complete(seed=2)
    assert first == second and first[1] == 5
    # what the request sets wins
    warm = [complete(seed=s, temperature=1.0, max_tokens=12) for s in (1, 2)]
    assert warm[0][1] == warm[1][1] == 12
    assert warm[0][0] != warm[1][0]
