"""Tool calling through the openai SDK against a real ``mmis serve`` (tiny Qwen2-VL).

One server for the module, with the fault knob on (``--fault-evict-rate 1``: P1 drops every
cached item, so each repeat of the image is a drift miss the recovery chain heals before
any byte). The tiny random model never calls a tool by itself, so:

- the tool definitions are shown to be in the prompt by its token count (``tool_choice:
  none`` leaves them out);
- ``auto`` runs the real parsing path on an output forced by a regex (``structured_outputs``)
  into the Hermes ``<tool_call>`` format: whole and streamed, tool calls, finish reason
  ``tool_calls``, no markup in the content;
- ``required`` and a named function are enforced by the structured-output path: their calls
  are well-formed and their arguments validate, streamed and not, across healed drift misses;
- a multi-turn conversation with an earlier call and its tool result renders and answers.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from procs import ServeFactory, image_url, openai_client

from mmis.tiny_models.tiny_model import tiny_model_dir

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(600)]

URL = image_url((220, 120, 30))
CITY = re.compile(r"[a-z]{1,8}")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
            "required": ["hour"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
FORCED = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}"\}\}\n'
    r"</tool_call>"
)


@pytest.fixture(scope="module")
def served(start_serve: ServeFactory) -> Iterator[tuple[openai.OpenAI, str]]:
    flags = ("--model", str(tiny_model_dir("qwen2-vl")), "--served-model-name", "tiny")
    with start_serve("serve-tools", *flags, "--fault-evict-rate", "1") as proc:
        yield openai_client(proc), proc.root_url


def _messages(image: bool = True) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "text", "text": "What is the weather?"}]
    if image:
        content.insert(0, {"type": "image_url", "image_url": {"url": URL}})
    return [{"role": "user", "content": content}]


def _chat(client: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("messages", _messages())
    kw.setdefault("max_tokens", 160)
    return client.chat.completions.create(model="tiny", temperature=0, **kw)


def _streamed(client: openai.OpenAI, **kw: Any) -> tuple[str, list[tuple[str, str, str]], str]:
    """(content, [(id, name, arguments)], finish_reason) of a streamed answer."""
    content, calls, finish = "", {}, None
    for chunk in _chat(client, stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            assert "<tool_call" not in (delta.content or "")
            content += delta.content or ""
            for call in delta.tool_calls or []:
                if call.index not in calls:
                    assert call.id and call.type == "function" and call.function.name
                    calls[call.index] = [call.id, call.function.name, ""]
                else:
                    assert call.id is None and call.function.name is None
                calls[call.index][2] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish  # type: ignore[misc]


def _retries(root: str) -> float:
    text = httpx.get(root + "/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("mmis_mm_retries_total{") and "chat" in line
    )


def _valid(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city"} and CITY.fullmatch(args["city"])
    else:
        assert name == "get_time" and set(args) == {"hour"}
        assert isinstance(args["hour"], int) and 0 <= args["hour"] <= 23


def test_tools_are_rendered_and_checked(served: tuple[openai.OpenAI, str]) -> None:
    client, _ = served
    plain = _chat(client, messages=_messages(image=False), max_tokens=1).usage.prompt_tokens
    offered = _chat(client, messages=_messages(image=False), max_tokens=1, tools=TOOLS)
    none = _chat(client, messages=_messages(False), max_tokens=1, tools=TOOLS, tool_choice="none")
    # the <tools> block holds both definitions: far more than their names' tokens
    assert offered.usage.prompt_tokens > plain + 100
    assert none.usage.prompt_tokens == plain
    bad = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ]
    for extra, param in bad:
        kw = {"tools": TOOLS, **extra}
        if kw["tools"] is None:
            del kw["tools"]
        with pytest.raises(openai.BadRequestError) as err:
            _chat(client, max_tokens=1, **kw)
        assert err.value.body["param"] == param  # type: ignore[index]


def test_auto_parses_a_forced_call(served: tuple[openai.OpenAI, str]) -> None:
    client, _ = served
    kw: dict[str, Any] = {"tools": TOOLS, "extra_body": {"structured_outputs": {"regex": FORCED}}}
    whole = _chat(client, **kw)
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    _valid("get_weather", call.function.arguments)
    content, calls, finish = _streamed(client, **kw)
    assert (content, finish) == ("", "tool_calls")
    assert [(n, a) for _, n, a in calls] == [("get_weather", call.function.arguments)]


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_enforced_choices_heal_drift(served: tuple[openai.OpenAI, str], choice: Any) -> None:
    client, root = served
    before = _retries(root)
    # one call at most: a random model could fill max_tokens with array items otherwise
    kw: dict[str, Any] = {"tools": TOOLS, "tool_choice": choice, "n": 2}
    kw["parallel_tool_calls"] = False
    finish = "tool_calls" if choice == "required" else "stop"
    for answer in (_chat(client, **kw), _chat(client, **kw)):  # the repeat is a drift miss
        for c in answer.choices:
            assert c.finish_reason == finish, c
            assert c.message.tool_calls
            for call in c.message.tool_calls:
                _valid(call.function.name, call.function.arguments)
            if choice != "required":
                assert [t.function.name for t in c.message.tool_calls] == ["get_time"]
    content, calls, streamed_finish = _streamed(
        client, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False
    )
    assert streamed_finish == finish and calls and not content
    for _, name, arguments in calls:
        _valid(name, arguments)
    assert _retries(root) >= before + 2  # drift misses were healed, not failed


def test_multi_turn_with_a_tool_result(served: tuple[openai.OpenAI, str]) -> None:
    client, _ = served
    messages = [
        *_messages(),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    answer = _chat(client, messages=messages, tools=TOOLS, max_tokens=4)
    first = _chat(client, messages=messages[:1], tools=TOOLS, max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length")
    # the call and its result are in the prompt (Qwen2.5's <tool_call> / <tool_response>)
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + 20
