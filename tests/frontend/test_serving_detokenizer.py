"""The incremental detokenizer: deltas add up to the final text; stop strings never leak;
a whole response (``TextGenerator.respond`` through the real recovery policy, against a fake
engine client) decodes each choice once."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, cast

from starlette.requests import Request

from mmis.frontend.api.schemas import CompletionRequest
from mmis.frontend.api.serving_completions import CompletionFormat
from mmis.frontend.api.serving_generate import TextGenerator
from mmis.frontend.client.lora import LoRARegistry
from mmis.frontend.client.output_processor import IncrementalDetokenizer
from mmis.frontend.client.recovery import RecoveryPolicy
from mmis.frontend.client.renderer import RenderedPrompt, SourcePrompt
from mmis.protocol.messages import EngineCoreOutput, EngineCoreRequest
from mmis.telemetry.metrics import MMISMetrics


# a byte-level "tokenizer": token i is byte i; decoding replaces broken UTF-8 by U+FFFD
def _decode(ids: Sequence[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def _feed(detok: IncrementalDetokenizer, data: bytes) -> list[str]:
    deltas = [detok.add([b], final=i == len(data) - 1) for i, b in enumerate(data)]
    return deltas


def test_deltas_concatenate_to_the_text_and_hold_back_partial_utf8() -> None:
    detok = IncrementalDetokenizer(_decode)
    data = "héllo ✓".encode()
    deltas = _feed(detok, data)
    assert "".join(deltas) == "héllo ✓"
    assert all("\ufffd" not in d for d in deltas)  # a half character is never streamed


def test_stop_string_cuts_the_text_and_is_never_partly_streamed() -> None:
    detok = IncrementalDetokenizer(_decode, stop=["END"])
    deltas = _feed(detok, b"abc ENxEND tail")
    assert "".join(deltas) == "abc ENx"
    assert detok.stopped_by == "END"
    assert detok.text == "abc ENx"
    assert detok.add([65]) == ""  # nothing after the stop


def test_held_back_prefix_is_released_at_the_end() -> None:
    detok = IncrementalDetokenizer(_decode, stop=["STOP"])
    deltas = _feed(detok, b"go ST")
    assert deltas == ["g", "o", " ", "", "ST"]  # "S" held while it may start "STOP"
    assert not detok.stopped


def test_each_step_decodes_a_window_not_the_whole_output() -> None:
    lengths: list[int] = []

    def counting(ids: Sequence[int]) -> str:
        lengths.append(len(ids))
        return _decode(ids)

    detok = IncrementalDetokenizer(counting, stop=["STOP"])
    data = ("x" * 500 + "é" * 100 + "ST" * 50 + "STOP").encode()
    deltas = _feed(detok, data)
    assert "".join(deltas) == "x" * 500 + "é" * 100 + "ST" * 50
    assert detok.stopped_by == "STOP"
    assert max(lengths) <= 4  # the previous character's bytes as context + the new ones


def test_a_stop_string_split_over_many_tokens_and_deltas_is_found() -> None:
    detok = IncrementalDetokenizer(_decode, stop=["<|end|>", "xyz"])
    deltas = [detok.add(list(chunk.encode())) for chunk in ("ab<", "|en", "d", "|>zz")]
    assert deltas == ["ab", "", "", ""]
    assert detok.stopped_by == "<|end|>" and detok.text == "ab"


class _Client:
    """A fake engine client (the interface :class:`RecoveryPolicy` and ``Generation`` use):
    every sibling's scripted outputs are queued at once, interleaved, when the requests
    arrive, so outputs after a stop string are already waiting (the race with P0's abort).
    ``release`` notes the decode calls made so far: the last release is the end of the watch."""

    alive, closed = True, False

    def __init__(self, script: list[list[tuple[str, str | None]]], decodes: list[int]) -> None:
        self.script, self.decodes = script, decodes
        self.aborted: list[str] = []
        self.decodes_at_release = 0

    async def add_requests(self, requests: list[EngineCoreRequest], queue: Any) -> None:
        assert [r.sampling_params.n for r in requests] == [1] * len(self.script)
        for step in range(max(map(len, self.script))):
            for request, outs in zip(requests, self.script, strict=True):
                if step < len(outs):
                    text, finish = outs[step]
                    queue.put_nowait(
                        EngineCoreOutput(request.request_id, list(text.encode()), finish)
                    )

    async def release(self, request_ids: list[str], abort: bool) -> None:
        if abort:
            self.aborted += request_ids
        if request_ids:
            self.decodes_at_release = len(self.decodes)


class _Renderer:
    """A text prompt renders to itself (no items): nothing here is about rendering."""

    async def render(
        self, source: SourcePrompt, *, bypass: bool, reserve_tokens: int, copies: int
    ) -> RenderedPrompt:
        return RenderedPrompt(list(source.token_ids), [[] for _ in range(copies)], 0, 0)

    def forget(self, rendered: RenderedPrompt) -> None:
        raise AssertionError("nothing failed to send")


async def _never() -> dict[str, Any]:
    await asyncio.Event().wait()  # the client never disconnects
    raise AssertionError("unreachable")


async def _respond(
    script: list[list[tuple[str, str | None]]], stop: list[str]
) -> tuple[dict[str, Any], int, int, list[str]]:
    """``TextGenerator.respond`` of a whole completion, through the real recovery policy and
    generation, against :class:`_Client`; the body, the decode calls during the watch and
    after it, and the engine requests aborted."""
    decodes: list[int] = []

    def decode(ids: Sequence[int]) -> str:
        decodes.append(len(ids))
        return _decode(ids)

    client = _Client(script, decodes)
    policy = RecoveryPolicy(cast(Any, _Renderer()), cast(Any, client), MMISMetrics("tiny"))
    state = SimpleNamespace(
        processor=SimpleNamespace(decode=decode),
        policy=policy,
        max_model_len=64,
        lora=LoRARegistry(cast(Any, None)),  # no adapter: the base model's requests
        model_name="tiny",
        served_names=("tiny",),
    )
    req = CompletionRequest.model_validate(
        {"prompt": [1, 2, 3], "n": len(script), "stop": stop or None, "max_tokens": 8}
    )
    http = Request({"type": "http"}, receive=_never)
    response = await TextGenerator(cast(Any, state), "completions").respond(
        http, req, SourcePrompt([1, 2, 3], [], "prompt"), CompletionFormat("tiny"), "cmpl-r"
    )
    during = client.decodes_at_release
    return json.loads(bytes(response.body)), during, len(decodes) - during, client.aborted


def _choices(body: dict[str, Any]) -> list[tuple[str, str | None]]:
    return [(c["text"], c["finish_reason"]) for c in body["choices"]]


async def test_a_whole_response_finishes_the_watched_detokenizers_instead_of_decoding_again() -> (
    None
):
    """With stop strings the watch has decoded every output as it arrived: the whole response
    reuses it (no decode of a stopped choice again), aborts the stopped choice in P1, and
    counts what a stream counts -- the tokens up to the output that completed the stop
    string, not the ones that raced it."""
    stopped = [("ab", None), ("cSTOPd", None), ("zz", None), ("y", "abort")]  # zz, y: the race
    running = [("ab", None), ("cST", None), ("OP", "length")]  # the stop is in the final output
    body, during, after, aborted = await _respond([stopped, running], ["STOP"])
    assert _choices(body) == [("abc", "stop"), ("abc", "stop")]
    assert body["usage"]["completion_tokens"] == 8 + 7 and body["usage"]["prompt_tokens"] == 3
    assert aborted == ["cmpl-r-a0-0"]  # the stopped choice; the other finished in P1
    assert during > 0
    assert after == 2  # one window decode (before, after) of the final output, for choice 1
    plain, none, fresh, aborted = await _respond([[("ab", None), ("c", "length")]], [])
    assert _choices(plain) == [("abc", "length")] and plain["usage"]["completion_tokens"] == 3
    assert none == 0 and aborted == []  # without stop strings nothing is watched
    assert fresh == 2  # decoded once, whole
