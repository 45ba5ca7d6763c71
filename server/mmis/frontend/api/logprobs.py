"""P0's side of logprobs: P1's :class:`~mmis.protocol.messages.TokenLogprobs` rows as text.

P1 computes the numbers (``engine/execution/logprobs.py``); here each token id becomes its text (the
tokenizer's decoding of that one token, special tokens included, as vLLM shows them) and its
UTF-8 bytes, and the rows become the two OpenAI layouts: chat's ``content`` list (token,
logprob, bytes, top_logprobs) and completions' columns (tokens, token_logprobs,
top_logprobs as ``{token: logprob}``, text_offset).

Invariants:
- One :class:`TokenLogprob` per generated token the answer keeps, in order: a choice cut by
  a stop string keeps the rows of the tokens before the cut only.
- ``offset`` is the position of the token's text in the choice's concatenated token texts
  (completions' ``text_offset``), running across the chunks of a stream.
- Prompt logprobs (completions ``echo`` with ``logprobs``): the rows of the first output's
  ``prompt_logprobs`` come first, one per prompt token, the first without a value
  (``TokenLogprob.first``: ``null`` in the layout); the generated rows' offsets continue after
  them. They are kept apart from :attr:`LogprobsBuilder.rows` (the generated tokens only):
  :meth:`LogprobsBuilder.kept` and :meth:`LogprobsBuilder.delta` (once, in a stream's first
  chunk) put them in front.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from mmis.frontend.api.schemas.responses import (
    ChatLogprobs,
    CompletionLogprobs,
    TopLogprob,
)
from mmis.frontend.api.schemas.responses import (
    TokenLogprob as ChatTokenLogprob,
)
from mmis.protocol.messages import EngineCoreOutput, TokenLogprobs


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
    first: bool = False  # the prompt's first token: no logprob (nothing precedes it)


class LogprobsBuilder:
    """Turns one choice's outputs into :class:`TokenLogprob` rows (one builder per choice)."""

    def __init__(self, token_text: Callable[[int], str]) -> None:
        self.token_text = token_text
        self.offset = 0
        self.rows: list[TokenLogprob] = []
        self.prompt_rows: list[TokenLogprob] = []
        self._prompt_sent = False

    def add(self, out: EngineCoreOutput) -> list[TokenLogprob]:
        """The rows of ``out``'s new tokens (also kept in :attr:`rows`); the prompt's rows, if
        ``out`` carries them, go to :attr:`prompt_rows` first."""
        if out.prompt_logprobs is not None and not self.prompt_rows:
            self.prompt_rows = self._rows(out.prompt_logprobs)
        lp = out.logprobs
        if lp is None:
            return []
        new = self._rows(lp)
        self.rows.extend(new)
        return new

    def _rows(self, lp: TokenLogprobs) -> list[TokenLogprob]:
        new: list[TokenLogprob] = []
        for ids, values in zip(lp.token_ids, lp.logprobs, strict=True):
            text = self.token_text(ids[0])
            if not values:  # the prompt's first token
                new.append(TokenLogprob(text, 0.0, self.offset, first=True))
            else:
                top = [
                    Alternative(self.token_text(t), v)
                    for t, v in zip(ids[1:], values[1:], strict=True)
                ]
                new.append(TokenLogprob(text, values[0], self.offset, top))
            self.offset += len(text)
        return new

    def delta(self, start: int, end: int) -> list[TokenLogprob]:
        """Generated rows ``[start, end)``, after the prompt's rows the first time they exist."""
        rows = self.rows[start:end]
        if self.prompt_rows and not self._prompt_sent:
            self._prompt_sent = True
            return [*self.prompt_rows, *rows]
        return rows

    def kept(self, num_tokens: int) -> list[TokenLogprob]:
        """The prompt's rows, then those of the first ``num_tokens`` generated tokens (what
        the answer keeps)."""
        return [*self.prompt_rows, *self.rows[:num_tokens]]


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
        out.text_offset.append(r.offset)
        if r.first:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(r.logprob)
        top: dict[str, float] = {}
        for a in r.top:  # two ids may show as the same text: keep the likelier one
            top.setdefault(a.token, a.logprob)
        out.top_logprobs.append(top)
    return out
