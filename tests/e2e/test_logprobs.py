"""``logprobs`` through the openai SDK against a real ``mmis serve`` (tiny LLaVA: conftest's
``tiny_serve``, shared with ``test_sampling_params``).

Chat (``logprobs`` / ``top_logprobs``) and completions (``logprobs: k``), whole and streamed:
one entry per generated token, alternatives sorted and as many as asked, the greedy pick is
the most likely token, a stream carries the same numbers as the whole answer, completions'
``text_offset`` runs over the token texts; out-of-range values are 400s naming the field.
Completions ``echo`` with ``logprobs`` (prompt logprobs): the prompt's tokens come first (the
first one ``null``), their values those of a plain transformers forward over the same ids.
"""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest
import torch

from mmis.tiny_models.tiny_model import tiny_model_dir

sys.path.insert(0, str(Path(__file__).parent))
from procs import Proc, image_url, openai_client

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(600)]

TOKENS = 6


@pytest.fixture(scope="module")
def client(tiny_serve: Proc) -> openai.OpenAI:
    return openai_client(tiny_serve)


def _messages() -> list[dict[str, object]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_url((200, 40, 90))}},
                {"type": "text", "text": "What is in the picture?"},
            ],
        }
    ]


def _chat(client: openai.OpenAI, **kw: object):  # type: ignore[no-untyped-def]
    return client.chat.completions.create(
        model="mmis-tiny",
        messages=_messages(),  # type: ignore[arg-type]
        max_tokens=TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
        **kw,
    )


def test_chat_logprobs_whole_and_streamed(client: openai.OpenAI) -> None:
    whole = _chat(client, logprobs=True, top_logprobs=3)
    (choice,) = whole.choices
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert whole.usage is not None and len(entries) == whole.usage.completion_tokens == TOKENS
    for entry in entries:
        assert entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode("utf-8"))
        top = entry.top_logprobs
        assert len(top) == 3
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert top[0].token == entry.token and top[0].logprob == pytest.approx(entry.logprob)
    streamed = []
    for chunk in _chat(client, logprobs=True, top_logprobs=3, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                streamed.extend(c.logprobs.content)
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in entries
    ]
    assert _chat(client).choices[0].logprobs is None  # not asked: none
    bare = _chat(client, logprobs=True).choices[0].logprobs
    assert bare is not None and bare.content and all(e.top_logprobs == [] for e in bare.content)


def test_completions_logprobs_whole_and_streamed(client: openai.OpenAI) -> None:
    kw = {"model": "mmis-tiny", "prompt": "Hello there", "max_tokens": TOKENS, "temperature": 0}
    whole = client.completions.create(logprobs=2, extra_body={"ignore_eos": True}, **kw)  # type: ignore[arg-type]
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.text_offset is not None
    assert len(lp.tokens) == TOKENS and lp.token_logprobs is not None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(TOKENS)]
    assert lp.top_logprobs is not None
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value is not None and value <= 0
        assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(value)  # greedy
        assert token in top
    streamed: list[str] = []
    offsets: list[int] = []
    stream = client.completions.create(  # type: ignore[call-overload]
        logprobs=2, stream=True, extra_body={"ignore_eos": True}, **kw
    )
    for chunk in stream:
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.tokens:
                streamed.extend(c.logprobs.tokens)
                offsets.extend(c.logprobs.text_offset or [])
    assert streamed == lp.tokens and offsets == lp.text_offset


def _prompt_reference(prompt: str) -> tuple[list[int], list[str], torch.Tensor]:
    """The tokenizer's ids of ``prompt`` (as P0 tokenizes it), each one's text, and the plain
    transformers model's ``log_softmax`` over them, row ``i`` predicting token ``i + 1``."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    path = tiny_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = [int(t) for t in tokenizer(prompt)["input_ids"]]
    texts = [str(tokenizer.decode([t], skip_special_tokens=False)) for t in ids]
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return ids, texts, torch.log_softmax(logits, dim=-1)


def test_completions_echo_with_logprobs_covers_the_prompt(client: openai.OpenAI) -> None:
    prompt, new = "Once upon a time there was a small cat", 3
    ids, texts, reference = _prompt_reference(prompt)
    kw = {"model": "mmis-tiny", "prompt": prompt, "max_tokens": new, "temperature": 0}
    extra = {"extra_body": {"ignore_eos": True}, "echo": True, "logprobs": 2}
    whole = client.completions.create(n=2, **extra, **kw)  # type: ignore[call-overload]
    first = whole.choices[0]
    assert first.text.startswith(prompt)
    lp = first.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    size = len(ids)
    assert len(lp.tokens) == size + new and lp.tokens[:size] == texts  # the tokenizer's ids
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = reference[:-1].gather(1, torch.tensor(ids[1:]).view(-1, 1)).view(-1)
    got = torch.tensor(lp.token_logprobs[1:size], dtype=torch.float32)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    best = reference[:-1].max(dim=-1).values
    tops = lp.top_logprobs[1:size]
    assert all(top is not None and 1 <= len(top) <= 2 for top in tops)
    assert torch.allclose(torch.tensor([max(t.values()) for t in tops if t]), best, atol=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(size + new)]
    other = whole.choices[1].logprobs  # every choice carries the same prompt rows
    assert other is not None and other.tokens is not None and other.token_logprobs is not None
    assert other.tokens[:size] == texts and other.token_logprobs[:size] == lp.token_logprobs[:size]
    tokens: list[str] = []
    values: list[float | None] = []
    chunks = list(client.completions.create(stream=True, **extra, **kw))  # type: ignore[call-overload]
    head = next(c.choices[0] for c in chunks if c.choices)
    assert head.text.startswith(prompt)  # the first chunk: the prompt and its rows
    assert head.logprobs is not None and (head.logprobs.tokens or [])[:size] == texts
    for chunk in chunks:
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.tokens:
                tokens.extend(c.logprobs.tokens)
                values.extend(c.logprobs.token_logprobs or [])
    assert tokens == lp.tokens
    assert values[0] is None and values[1:size] == pytest.approx(
        lp.token_logprobs[1:size], abs=1e-5
    )


def test_out_of_range_values_are_400_naming_the_field(client: openai.OpenAI) -> None:
    for kw, param in (
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ):
        with pytest.raises(openai.BadRequestError) as bad:
            _chat(client, **kw)
        assert param in str(bad.value)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="mmis-tiny", prompt="hi", logprobs=6)
    assert "logprobs" in str(bad.value)
