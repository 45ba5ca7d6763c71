"""Structured outputs through the openai SDK against a real ``mmis serve`` (tiny random LLaVA).

One server (CI budget: conftest's ``tiny_serve_evicting``, shared with
``test_responses_api``), with the operator-only fault knob on (``--fault-evict-rate 1``: P1
evicts every cached image, so a request that names an image P0 believes cached misses and
is healed by the one retry; text-only requests are unaffected).
The tiny model is random: every valid output below is the constraint's doing. Checked:
``response_format`` json_schema (strict) and json_object on chat, whole and streamed; vLLM's
``structured_outputs`` regex / choice / json on completions; seeded ``n = 3``; a schema or
regex that does not compile is a 400 naming the field (streamed too); a healed drift miss
still yields schema-valid JSON; and the acceptance: 100 concurrent json_schema requests all
return JSON that validates against the schema.
"""

from __future__ import annotations

import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from procs import Proc, image_url, openai_client

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(600)]

# bounded: every string has a maxLength, the array maxItems, no free-form object
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "pet": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog"]}, "good": {"type": "boolean"}},
            "required": ["kind", "good"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "color", "tags", "pet"],
    "additionalProperties": False,
}
VALIDATOR = jsonschema_rs.validator_for(SCHEMA)
FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
}
MAX_TOKENS = 160  # the schema's longest output is well under this many tokens


@pytest.fixture(scope="module")
def serve(tiny_serve_evicting: Proc) -> Proc:
    return tiny_serve_evicting


@pytest.fixture(scope="module")
def client(serve: Proc) -> openai.OpenAI:
    return openai_client(serve, timeout=300)


def _chat(client: openai.OpenAI, content: Any = "Describe a person.", **kw: Any) -> Any:
    kw.setdefault("max_tokens", MAX_TOKENS)
    kw.setdefault("temperature", 1.0)
    messages = [{"role": "user", "content": content}]
    return client.chat.completions.create(model="tiny", messages=messages, **kw)


def _valid(text: str) -> dict[str, Any]:
    value = json.loads(text)
    assert VALIDATOR.is_valid(value), (text, [str(e) for e in VALIDATOR.iter_errors(value)])
    return value  # type: ignore[no-any-return]


def test_chat_json_schema_whole_and_streamed(client: openai.OpenAI) -> None:
    whole = _chat(client, response_format=FORMAT, seed=7)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop"
    _valid(choice.message.content)
    chunks = list(_chat(client, response_format=FORMAT, seed=7, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert text == choice.message.content  # same seed, same constrained draw
    assert _chat(client, seed=7, max_tokens=30).choices[0].message.content != text


def test_chat_json_object_and_seeded_n3(client: openai.OpenAI) -> None:
    reply = _chat(client, response_format={"type": "json_object"}, seed=3, max_tokens=60)
    for choice in reply.choices:
        text = choice.message.content
        assert text.startswith("{")
        if choice.finish_reason == "stop":  # free-form JSON may also run to max_tokens
            assert isinstance(json.loads(text), dict)

    def texts() -> list[str]:
        reply = _chat(client, response_format=FORMAT, n=3, seed=11)
        return [c.message.content for c in sorted(reply.choices, key=lambda c: c.index)]

    first = texts()
    assert [_valid(t) for t in first] and len(set(first)) > 1
    assert texts() == first


def test_completions_regex_choice_and_json(client: openai.OpenAI) -> None:
    def complete(stream: bool = False, **structured: Any) -> tuple[str, str | None]:
        kw = {"extra_body": {"structured_outputs": structured}, "temperature": 1.0}
        if not stream:
            c = client.completions.create(model="tiny", prompt="Go:", max_tokens=40, **kw).choices[
                0
            ]
            return c.text, c.finish_reason
        parts = list(
            client.completions.create(model="tiny", prompt="Go:", max_tokens=40, stream=True, **kw)
        )
        return "".join(p.choices[0].text for p in parts if p.choices), parts[-1].choices[
            0
        ].finish_reason

    for stream in (False, True):
        text, reason = complete(stream, regex=r"[0-9]{3}-[a-z]{2,4}")
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text) and reason == "stop", text
        text, reason = complete(stream, choice=["alpha", "beta gamma", "δ"])
        assert text in ("alpha", "beta gamma", "δ") and reason == "stop", text
    text, reason = complete(
        json={
            "type": "object",
            "properties": {"n": {"type": "integer", "maximum": 9, "minimum": 0}},
            "required": ["n"],
            "additionalProperties": False,
        }
    )
    assert reason == "stop" and 0 <= json.loads(text)["n"] <= 9
    reply = client.completions.create(
        model="tiny", prompt="Go:", max_tokens=MAX_TOKENS, extra_body={"response_format": FORMAT}
    )
    _valid(reply.choices[0].text)


@pytest.mark.parametrize(
    ("kw", "param", "needle"),
    [
        (  # P1's grammar engine refuses it: the 400 still names the field
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
            "nope",
        ),
        (
            {"extra_body": {"structured_outputs": {"regex": "(unclosed"}}},
            "structured_outputs",
            "regex",
        ),
        (
            {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}},
            "structured_outputs",
            "exactly one",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!"}}},
            "response_format",
            "name",
        ),
    ],
)
def test_a_bad_constraint_is_a_400_naming_the_field(
    client: openai.OpenAI, kw: Any, param: str, needle: str
) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            reply = _chat(client, max_tokens=4, stream=stream, **kw)
            if stream:
                list(reply)
        error = info.value.body
        assert isinstance(error, dict) and str(error["param"]).startswith(param), error
        assert needle in error["message"], error


def test_a_healed_drift_miss_still_gives_schema_valid_json(
    serve: Proc, client: openai.OpenAI
) -> None:
    def misses() -> float:
        text = httpx.get(serve.root_url + "/metrics", timeout=30).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("mmis_drift_misses_total")
        )

    content = [
        {"type": "image_url", "image_url": {"url": image_url((30, 160, 90))}},
        {"type": "text", "text": "Who is this?"},
    ]
    before = misses()
    for stream in (False, True, False):  # the 2nd and 3rd name an image P1 evicted on purpose
        if stream:
            chunks = list(_chat(client, content, response_format=FORMAT, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = _chat(client, content, response_format=FORMAT).choices[0].message.content
        _valid(text)
    assert misses() >= before + 2


def test_hundred_concurrent_json_schema_requests_all_validate(client: openai.OpenAI) -> None:
    def one(k: int) -> tuple[str, str]:
        reply = _chat(client, f"Person number {k}?", response_format=FORMAT, seed=k)
        return reply.choices[0].message.content, reply.choices[0].finish_reason

    with ThreadPoolExecutor(max_workers=32) as pool:
        results = list(pool.map(one, range(100)))
    assert all(reason == "stop" for _, reason in results), [r for _, r in results]
    values = [_valid(text) for text, _ in results]
    assert len({json.dumps(v, sort_keys=True) for v in values}) > 50  # really sampled


def test_completions_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    """(Not a structured output: ``echo`` shares this module's server.)"""
    kw: dict[str, Any] = {"model": "tiny", "max_tokens": 5, "temperature": 0, "echo": True}
    whole = client.completions.create(prompt="Once upon", **kw).choices[0].text
    plain = client.completions.create(prompt="Once upon", **{**kw, "echo": False}).choices[0]
    assert whole == "Once upon" + plain.text
    parts = list(client.completions.create(prompt="Once upon", stream=True, **kw))
    assert parts[0].choices[0].text.startswith("Once upon")
    assert "".join(p.choices[0].text for p in parts if p.choices) == whole
