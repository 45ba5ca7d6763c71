"""P0's logprobs in the two OpenAI layouts: chat's ``content`` list (token, logprob, bytes,
top_logprobs) and completions' columns (tokens, token_logprobs, top_logprobs as
``{token: logprob}``, text_offset).

The rows come from the client (``frontend/client/output_processor.py`` ``LogprobsBuilder``:
each token id as its text, the offsets, the prompt's rows first); this module only lays them
out. Invariant: one entry per row, in order; the prompt's first token
(``TokenLogprob.first``) has ``null`` for its logprob and alternatives in completions' layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from mmis.frontend.api.schemas.responses import (
    ChatLogprobs,
    CompletionLogprobs,
    TopLogprob,
)
from mmis.frontend.api.schemas.responses import (
    TokenLogprob as ChatTokenLogprob,
)
from mmis.frontend.client.output_processor import TokenLogprob

__all__ = ["TokenLogprob", "chat", "completion"]


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
