"""The OpenAI sampling parameters through a real ``mmis serve`` process and the openai SDK.

One server (CI budget): conftest's ``tiny_serve``, shared with ``test_logprobs``. Greedy
outputs of the tiny model show what each parameter does: ``logit_bias`` +100 forces a token,
a frequency / presence / repetition penalty stops the repeats of the plain greedy output;
streamed and whole answers agree; a seeded ``n = 3`` request is reproducible while its
choices differ; out-of-range values and bad ``logit_bias`` keys are 400s naming the field
(token ids beyond the vocabulary are refused by the engine, streamed or not).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from procs import Proc, openai_client

from mmis.tiny_models.tiny_model import tiny_model_dir

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = "The quick brown fox jumps over the lazy dog."
TOKENS = 24


@pytest.fixture(scope="module")
def client(tiny_serve: Proc) -> openai.OpenAI:
    return openai_client(tiny_serve, api_key="unused")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir())


def _chat(client: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("max_tokens", TOKENS)
    kw.setdefault("temperature", 0)
    messages = [{"role": "user", "content": PROMPT}]
    return client.chat.completions.create(model="tiny", messages=messages, **kw)


def _streamed_text(client: openai.OpenAI, **kw: Any) -> str:
    chunks = _chat(client, stream=True, **kw)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _completion_ids(client: openai.OpenAI, tokenizer: Any, **kw: Any) -> list[int]:
    """Greedy ``/v1/completions`` output, re-tokenized (to count repeats)."""
    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=TOKENS, temperature=0, **kw
    )
    return list(tokenizer(reply.choices[0].text, add_special_tokens=False)["input_ids"])


def test_logit_bias_forces_a_token_streamed_and_not(client, tokenizer):
    token = tokenizer("fox", add_special_tokens=False)["input_ids"][0]
    forced = tokenizer.decode([token] * 8, skip_special_tokens=True)
    whole = _chat(client, max_tokens=8, logit_bias={str(token): 100})
    assert whole.choices[0].message.content == forced
    assert whole.usage.completion_tokens == 8
    assert _streamed_text(client, max_tokens=8, logit_bias={str(token): 100}) == forced
    assert _chat(client, max_tokens=8).choices[0].message.content != forced


def test_penalties_stop_repeats_streamed_and_not(client, tokenizer):
    plain = _chat(client).choices[0].message.content
    penalized = {
        "frequency": {"frequency_penalty": 2.0},
        "presence": {"presence_penalty": 2.0},
        "both, min_p": {
            "frequency_penalty": 1.0,
            "presence_penalty": 1.0,
            "extra_body": {"min_p": 0.1},
        },
    }
    for name, params in penalized.items():
        whole = _chat(client, **params).choices[0].message.content
        assert whole != plain, name
        assert _streamed_text(client, **params) == whole, name
    # repetition_penalty is an extension: the SDK sends it in the body as is
    base = _completion_ids(client, tokenizer)
    rep = _completion_ids(client, tokenizer, extra_body={"repetition_penalty": 5.0})
    assert len(set(base)) < len(base)  # the plain greedy output repeats itself ...
    assert rep != base
    assert len(set(rep)) > len(set(base))  # ... the penalized one much less


def test_seeded_n3_is_reproducible_and_its_choices_differ(client):
    def texts() -> list[str]:
        reply = _chat(client, n=3, seed=1234, temperature=1.0, max_tokens=12)
        return [c.message.content for c in sorted(reply.choices, key=lambda c: c.index)]

    first = texts()
    assert texts() == first
    assert len(set(first)) == 3
    other = _chat(client, n=3, seed=99, temperature=1.0, max_tokens=12)
    assert sorted(c.message.content for c in other.choices) != sorted(first)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"extra_body": {"min_p": 1.5}}, "min_p"),
        ({"logit_bias": {"fox": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
    ],
)
def test_out_of_range_values_are_400s_naming_the_field(client, params, param):
    for endpoint in ("chat", "completions"):
        with pytest.raises(openai.BadRequestError) as info:
            if endpoint == "chat":
                _chat(client, max_tokens=2, **params)
            else:
                client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, **params)
        error = info.value.body
        assert isinstance(error, dict)
        assert str(error["param"]).startswith(param), (endpoint, error)


def test_a_token_beyond_the_vocabulary_is_a_400_naming_logit_bias(client, tokenizer):
    beyond = str(len(tokenizer) + 1000)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            reply = _chat(client, max_tokens=2, stream=stream, logit_bias={beyond: 5})
            if stream:
                list(reply)
        assert "logit_bias" in str(info.value), info.value
        assert beyond in str(info.value)
