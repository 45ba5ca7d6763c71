"""The incremental detokenizer: deltas add up to the final text; stop strings never leak."""

from __future__ import annotations

from collections.abc import Sequence

from mmis.frontend.api.detokenizer import IncrementalDetokenizer


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
