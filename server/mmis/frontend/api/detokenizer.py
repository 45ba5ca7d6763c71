"""Incremental detokenization of one choice; P0 is the only place stop strings are matched.

Each :meth:`IncrementalDetokenizer.add` costs time in the new tokens and the held-back tail
only, never in the whole output: text is decoded over a small window (the tokens of the
previous delta as context, then the new ones, as vLLM does), and stop strings are searched in
the held-back tail plus the new text.

Invariants:
- The text emitted so far is a prefix of the choice's text cut at the first stop string:
  deltas concatenate to the final text.
- A decoded tail that ends in U+FFFD (an incomplete UTF-8 sequence of a byte-level BPE) is
  held back until the next token completes it, or until the choice finishes.
- The held-back tail is the longest suffix that is a proper prefix of a stop string (so
  shorter than the longest stop), so a stop string is never partly streamed and any later
  match starts inside the tail or the new text; once one matches, the text stops right before
  it and :attr:`stopped_by` names it (the caller finishes the choice with
  ``finish_reason="stop"`` and aborts its request in P1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = [s for s in stop if s]
        self.token_ids: list[int] = []
        self._prefix = 0  # first token of the decode window (context for the next delta)
        self._read = 0  # tokens whose text has been decoded
        self._pending = ""  # decoded, not yet emitted (could start a stop string)
        self._emitted: list[str] = []
        self.stopped_by: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stopped_by is not None

    def add(self, new_token_ids: Sequence[int], *, final: bool = False) -> str:
        """Append tokens; return the newly *safe* text (possibly empty)."""
        if self.stopped:
            return ""
        self.token_ids.extend(int(t) for t in new_token_ids)
        text = self._pending + self._decode_new(final)
        cut = -1
        for stop in self._stop:
            at = text.find(stop)
            if at != -1 and (cut == -1 or at < cut):
                cut, self.stopped_by = at, stop
        if cut != -1:
            return self._emit(text[:cut], "")
        keep = 0 if final else self._held_back(text)
        return self._emit(text[: len(text) - keep], text[len(text) - keep :])

    def _decode_new(self, final: bool) -> str:
        """The text of the tokens not decoded yet ("" while it ends in a broken character)."""
        if self._read == len(self.token_ids):
            return ""
        before = self._decode(self.token_ids[self._prefix : self._read])
        after = self._decode(self.token_ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self.token_ids)
        return after[len(before) :]

    def _held_back(self, text: str) -> int:
        keep = 0
        for stop in self._stop:  # a suffix that is a proper prefix of a stop string
            for k in range(min(len(stop) - 1, len(text)), keep, -1):
                if text.endswith(stop[:k]):
                    keep = k
                    break
        return keep

    def _emit(self, delta: str, pending: str) -> str:
        self._pending = pending
        if delta:
            self._emitted.append(delta)
        return delta

    @property
    def text(self) -> str:
        """Everything returned so far."""
        return "".join(self._emitted)
