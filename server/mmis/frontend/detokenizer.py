"""Incremental detokenization of one choice, with stop strings applied in P0.

Invariants:
- The text emitted so far is always a prefix of ``decode(all tokens)`` cut at the first stop
  string: deltas concatenate to exactly the final text.
- A decoded tail that ends in U+FFFD (an incomplete UTF-8 sequence of a byte-level BPE) is
  held back until the next token completes it, or until the choice finishes.
- Text that could still turn out to be the start of a stop string is held back as well, so a
  stop string is never partly streamed; once one matches, the text stops there and the choice
  is finished with ``finish_reason="stop"``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = [s for s in stop if s]
        self.token_ids: list[int] = []
        self._emitted = 0  # characters of the final text already returned
        self.stopped_by: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stopped_by is not None

    def add(self, new_token_ids: Sequence[int], *, final: bool = False) -> str:
        """Append tokens; return the newly *safe* text (possibly empty)."""
        if self.stopped:
            return ""
        self.token_ids.extend(int(t) for t in new_token_ids)
        text = self._decode(self.token_ids)
        end = len(text)
        for stop in self._stop:
            at = text.find(stop)
            if at != -1 and at < end:
                end = at
                self.stopped_by = stop
        if self.stopped:
            return self._take(text, end)
        if not final:
            end = self._hold_back(text)
        return self._take(text, end)

    def _hold_back(self, text: str) -> int:
        end = len(text)
        while end > self._emitted and text[end - 1] == _REPLACEMENT:
            end -= 1
        safe = end
        for stop in self._stop:  # a suffix that is a proper prefix of a stop string
            for k in range(min(len(stop) - 1, end), 0, -1):
                if text[end - k : end] == stop[:k]:
                    safe = min(safe, end - k)
                    break
        return max(safe, self._emitted)

    def _take(self, text: str, end: int) -> str:
        end = max(end, self._emitted)
        delta = text[self._emitted : end]
        self._emitted = end
        return delta

    @property
    def text(self) -> str:
        """Everything returned so far."""
        return self._decode(self.token_ids)[: self._emitted]
