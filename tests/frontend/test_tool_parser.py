"""The tool-call parsers (``mmis.frontend.api.tool_calls``) on their own: whole answers, and
streams split at every character boundary (and fed one character at a time) give the same
content and calls, with no markup in any content delta."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from mmis.frontend.api.tool_calls import (
    HermesParser,
    NamedParser,
    Parsed,
    RequiredParser,
    ToolCallParser,
    scan_object,
)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call>'
NESTED = '{"x": [1, 2.5e3, {"y": "}\\" </tool_call>"}], "é": true, "n": null}'

HERMES_CASES = [
    (CALL, None, [("get_weather", '{"city": "paris"}')]),
    (
        "Let me check.\n" + CALL + '\n<tool_call>{"name":"b","arguments":' + NESTED + "}"
        "</tool_call>\nbye",
        "Let me check.\n",
        [("get_weather", '{"city": "paris"}'), ("b", NESTED)],
    ),
    (
        '<tool_call>{"arguments": {"k": 10}, "name": "late"}</tool_call>',
        None,
        [("late", '{"k": 10}')],
    ),
    ('<tool_call>{"name": "f"}</tool_call>', None, [("f", "{}")]),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}', None, [("f", '{"a": 1}')]),
    ("a < b, <tool and <tool_ca", "a < b, <tool and <tool_ca", []),
    ("no calls at all", "no calls at all", []),
]

MALFORMED = [
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
    '<tool_call>{"name": "f" "arguments": {}}</tool_call>',
    'hi <tool_call>{"name": "f", "arguments": {"a": ',
    "<tool_call>not json</tool_call>",
]


def _stream(make: Callable[[], ToolCallParser], pieces: list[str]) -> tuple[str, Parsed, list]:
    parser = make()
    content, deltas = "", []
    for i, piece in enumerate(pieces):
        out = parser.feed(piece, final=i == len(pieces) - 1)
        assert "<tool_call" not in out.content and "</tool_call" not in out.content
        content += out.content
        deltas.extend(out.tool_calls)
    return content, parser.result(), deltas


def _assemble(deltas: list) -> list[tuple[str, str, str]]:
    """(id, name, arguments) per call index, checking the OpenAI delta order."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.index not in calls:
            assert d.id and d.id.startswith("call_") and d.type == "function"
            assert d.function.name and d.function.arguments == ""
            calls[d.index] = [d.id, d.function.name, ""]
        else:
            assert d.id is None and d.function.name is None
            calls[d.index][2] += d.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(calls[i]) for i in sorted(calls)]  # type: ignore[misc]


def _splits(text: str) -> list[list[str]]:
    two = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    return [*two, list(text) or [""]]


def _check_streams(make: Callable[[], ToolCallParser], text: str) -> Parsed:
    whole = make()
    whole.feed(text, final=True)
    expected = whole.result()
    for pieces in _splits(text):
        content, streamed, deltas = _stream(make, pieces)
        got = _assemble(deltas)
        assert [(n, a) for _, n, a in got] == [
            (c.function.name, c.function.arguments) for c in expected.tool_calls
        ], pieces
        assert [c.id for c in streamed.tool_calls] == [i for i, _, _ in got]
        if expected.tool_calls:
            assert content == (expected.content or ""), pieces
    return expected


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_whole_and_streamed(text: str, content: str | None, calls: list) -> None:
    parsed = _check_streams(HermesParser, text)
    assert parsed.content == content
    assert [(c.function.name, c.function.arguments) for c in parsed.tool_calls] == calls
    for call in parsed.tool_calls:
        assert isinstance(json.loads(call.function.arguments), dict)
    if not calls:  # plain text streams as itself, held-back prefixes released at the end
        for pieces in _splits(text):
            assert _stream(HermesParser, pieces)[0] == text


@pytest.mark.parametrize("text", MALFORMED)
def test_hermes_malformed_is_content(text: str) -> None:
    parser = HermesParser()
    parser.feed(text, final=True)
    assert parser.result() == Parsed(text, [])
    assert parser.finish("stop") == "stop"


def test_finish_reasons_and_parallel() -> None:
    parser = HermesParser()
    parser.feed(CALL + CALL, final=True)
    assert len(parser.result().tool_calls) == 2
    assert parser.finish("stop") == "tool_calls" and parser.finish("length") == "length"
    single = HermesParser(parallel=False)
    single.feed(CALL + CALL, final=True)
    assert len(single.result().tool_calls) == 1


def test_required_array() -> None:
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": ' + NESTED + "}]"
    parsed = _check_streams(RequiredParser, text)
    assert parsed.content is None
    assert [(c.function.name, c.function.arguments) for c in parsed.tool_calls] == [
        ("a", '{"x": 1}'),
        ("b", NESTED),
    ]
    cut = RequiredParser()
    cut.feed(text[:30], final=True)
    assert cut.result() == Parsed(text[:30], [])  # cut by max_tokens: no calls


def test_named_is_the_arguments() -> None:
    text = '{"city": "paris"}'
    parsed = _check_streams(lambda: NamedParser("get_weather"), text)
    (call,) = parsed.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", text)
    assert NamedParser("f").finish("stop") == "stop"


def test_scan_object_frontier() -> None:
    scan = scan_object('{"name": "f", "arguments": {"a": 12', 0)
    assert "name" in scan.values and scan.open_key == "arguments" and scan.end is None
    assert not scan.malformed
    assert scan_object('{"name": "f", "n": 12', 0).open_key == "n"  # the number may grow
    assert scan_object('{"name": "f", "arguments": {"a": ]', 0).malformed
