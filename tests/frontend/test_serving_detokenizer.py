"""The incremental detokenizer: deltas add up to the final text; stop strings never leak;
a whole response decodes each choice once."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, cast

from pydantic import BaseModel

from mmis.frontend.api.detokenizer import IncrementalDetokenizer
from mmis.frontend.api.serving_generate import TextGenerator
from mmis.protocol.messages import EngineCoreOutput


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


class _Body(BaseModel):
    choices: list[tuple[str, str | None]]
    completion_tokens: int


def _whole_response(
    outputs: list[list[EngineCoreOutput]], stop: list[str]
) -> tuple[_Body, int, int]:
    """Run ``TextGenerator._whole`` the way ``respond`` does (the watch fed each unfinished
    output as it arrived); return the body and the decode calls during and after the watch."""
    calls = [0]

    def decode(ids: Sequence[int]) -> str:
        calls[0] += 1
        return _decode(ids)

    state = SimpleNamespace(processor=SimpleNamespace(decode=decode))
    generator = TextGenerator(cast(Any, state), "completions")
    req = cast(Any, SimpleNamespace(stop_list=lambda: stop, logprobs_count=lambda: None))
    watched = [generator._detokenizer(req) for _ in outputs] if stop else []
    for detok, outs in zip(watched, outputs if stop else [], strict=True):  # as collect()
        for out in outs:
            if out.finish_reason is None and not detok.stopped:
                detok.add(out.new_token_ids)
    during = calls[0]
    fmt = SimpleNamespace(
        whole=lambda rid, choices, usage: _Body(
            choices=[(text, finish) for text, finish, _ in choices],
            completion_tokens=usage.completion_tokens,
        )
    )
    response = generator._whole(
        req, cast(Any, fmt), "r", cast(Any, SimpleNamespace(num_tokens=3)), outputs, watched
    )
    return _Body.model_validate_json(bytes(response.body)), during, calls[0] - during


def _out(text: str, finish: str | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(request_id="r", new_token_ids=list(text.encode()), finish_reason=finish)


def test_a_whole_response_finishes_the_watched_detokenizers_instead_of_decoding_again() -> None:
    """With stop strings the watch has decoded every output as it arrived: the whole response
    reuses it (no decode of a stopped choice again) and counts what a stream counts -- the
    tokens up to the output that completed the stop string, not the ones that raced it."""
    stopped = [_out("ab"), _out("cSTOPd"), _out("zz"), _out("y", "abort")]  # zz, y: the race
    running = [_out("ab"), _out("cST"), _out("OP", "length")]  # the stop is in the final output
    body, during, after = _whole_response([stopped, running], ["STOP"])
    assert body.choices == [("abc", "stop"), ("abc", "stop")]
    assert body.completion_tokens == 8 + 7
    assert during > 0
    assert after == 2  # one window decode (before, after) of the final output, for choice 1
    plain, _, fresh = _whole_response([[_out("ab"), _out("c", "length")]], [])
    assert plain.choices == [("abc", "length")] and plain.completion_tokens == 3
    assert fresh == 2  # without stop strings nothing watched: decoded once, whole
