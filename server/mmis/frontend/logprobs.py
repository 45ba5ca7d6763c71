"""P0's side of logprobs: P1's :class:`~mmis.protocol.messages.TokenLogprobs` rows as text.

P1 computes the numbers (``engine/logprobs.py``); here each token id becomes its text (the
tokenizer's decoding of that one token, special tokens included, as vLLM shows them) and its
UTF-8 bytes, and the rows become the two OpenAI layouts: chat's ``content`` list (token,
logprob, bytes, top_logprobs) and completions' columns (tokens, token_logprobs,
top_logprobs as ``{token: logprob}``, text_offset).

Invariants:
- One :class:`TokenLogprob` per generated token the answer keeps, in order: a choice cut by
  a stop string keeps the rows of the tokens before the cut only.
- ``offset`` is the position of the token's text in the choice's concatenated token texts
  (completions' ``text_offset``), running across the chunks of a stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from mmis.frontend.schemas.responses import (
    ChatLogprobs,
    CompletionLogprobs,
    TopLogprob,
)
from mmis.frontend.schemas.responses import (
    TokenLogprob as ChatTokenLogprob,
)
from mmis.protocol.messages import EngineCoreOutput


@dataclass(frozen=True, slots=True)
class Alternative:
    token: str
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: str
    logprob: float
    offset: int
    top: list[Alternative] = field(default_factory=list)


class LogprobsBuilder:
    """Turns one choice's outputs into :class:`TokenLogprob` rows (one builder per choice)."""

    def __init__(self, token_text: Callable[[int], str]) -> None:
        self.token_text = token_text
        self.offset = 0
        self.rows: list[TokenLogprob] = []

    def add(self, out: EngineCoreOutput) -> list[TokenLogprob]:
        """The rows of ``out``'s new tokens (also kept in :attr:`rows`)."""
        lp = out.logprobs
        if lp is None:
            return []
        new: list[TokenLogprob] = []
        for ids, values in zip(lp.token_ids, lp.logprobs, strict=True):
            text = self.token_text(ids[0])
            top = [
                Alternative(self.token_text(t), v) for t, v in zip(ids[1:], values[1:], strict=True)
            ]
            new.append(TokenLogprob(text, values[0], self.offset, top))
            self.offset += len(text)
        self.rows.extend(new)
        return new

    def kept(self, num_tokens: int) -> list[TokenLogprob]:
        """The rows of the first ``num_tokens`` tokens (what the answer keeps)."""
        return self.rows[:num_tokens]


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat(rows: Sequence[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=r.token,
                logprob=r.logprob,
                bytes=_bytes(r.token),
                top_logprobs=[
                    TopLogprob(token=a.token, logprob=a.logprob, bytes=_bytes(a.token))
                    for a in r.top
                ],
            )
            for r in rows
        ]
    )


def completion(rows: Iterable[TokenLogprob]) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for r in rows:
        out.tokens.append(r.token)
        out.token_logprobs.append(r.logprob)
        top: dict[str, float] = {}
        for a in r.top:  # two ids may show as the same text: keep the likelier one
            top.setdefault(a.token, a.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(r.offset)
    return out
