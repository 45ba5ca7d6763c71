"""Log-probabilities of sampled tokens, for the requests that ask (``SamplingParams.logprobs``).

Invariants:
- Computed from the model's logits of the step (``log_softmax`` in float32), before any
  sampling parameter touches them (bias, penalties, temperature, top-k/p), as vLLM's default
  ``raw_logprobs`` mode: the values describe the model, whatever sampler settings the
  request used. :func:`prepare` must therefore run before the sampler, which may change the
  logits in place.
- One batched pass over the rows that asked (no per-request device work): a ``log_softmax``
  of those rows, one ``topk`` of the largest ``k`` asked for, and one host copy after the
  sampled tokens are known (:func:`finish`); rows that did not ask cost nothing.
- Row ``i`` of the result is ``[sampled, top_1 .. top_k]`` ids with their log-probabilities
  and the sampled token's rank (1 = most likely), the layout of
  :class:`~mmis.protocol.messages.TokenLogprobs`.
- Prompt logprobs (``SamplingParams.prompt_logprobs``, :func:`score`): the same numbers for
  given tokens instead of sampled ones: logits row ``i`` scores ``targets[i]`` (the NEXT
  prompt token), in float32, in slices of :data:`SCORE_ROWS` rows to bound the memory of a
  long prompt chunk. :func:`first_prompt_row` is row 0 (no value: nothing precedes it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmis.protocol.messages import SamplingParams, TokenLogprobs

SCORE_ROWS = 256  # prompt rows log-softmaxed at once


@dataclass
class Pending:
    """The rows that asked, their log-softmax and top-k, waiting for the sampled tokens."""

    rows: list[int]
    ks: list[int]
    logprobs: torch.Tensor  # [R, V] float32
    top_values: torch.Tensor  # [R, max k]
    top_ids: torch.Tensor  # [R, max k]


def prepare(logits: torch.Tensor, params: Sequence[SamplingParams | None]) -> Pending | None:
    """Start the rows of ``logits`` whose params ask for logprobs (``None``: no row asks)."""
    rows = [i for i, p in enumerate(params) if p is not None and p.logprobs is not None]
    if not rows:
        return None
    ks = [int(params[i].logprobs or 0) for i in rows]  # type: ignore[union-attr]
    index = torch.tensor(rows, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    k = max(ks)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0])
    return Pending(rows, ks, logprobs, top_values, top_ids.long())


def finish(pending: Pending, sampled: torch.Tensor) -> dict[int, TokenLogprobs]:
    """Row index -> the logprobs of its sampled token (``sampled``: ``[S]`` token ids)."""
    index = torch.tensor(pending.rows, device=sampled.device)
    chosen = sampled.index_select(0, index).long().view(-1, 1)
    chosen_lp = pending.logprobs.gather(1, chosen.to(pending.logprobs.device))
    ranks = (pending.logprobs > chosen_lp).sum(dim=-1) + 1
    chosen_ids = chosen.view(-1).tolist()
    chosen_values = chosen_lp.view(-1).tolist()
    rank_list = ranks.tolist()
    top_ids = pending.top_ids.tolist()
    top_values = pending.top_values.tolist()
    out: dict[int, TokenLogprobs] = {}
    for j, (row, k) in enumerate(zip(pending.rows, pending.ks, strict=True)):
        out[row] = TokenLogprobs(
            token_ids=[[chosen_ids[j], *top_ids[j][:k]]],
            logprobs=[[chosen_values[j], *top_values[j][:k]]],
            ranks=[int(rank_list[j])],
        )
    return out


def score(logits: torch.Tensor, targets: Sequence[int], k: int) -> TokenLogprobs:
    """Row ``i``: ``targets[i]``'s log-probability under ``logits[i]``, rank and top ``k``."""
    out = TokenLogprobs()
    for lo in range(0, len(targets), SCORE_ROWS):
        chunk = logits[lo : lo + SCORE_ROWS]
        logprobs = torch.log_softmax(chunk.float(), dim=-1)
        chosen = torch.tensor(targets[lo : lo + SCORE_ROWS], device=logprobs.device).view(-1, 1)
        chosen_lp = logprobs.gather(1, chosen)
        ranks = ((logprobs > chosen_lp).sum(dim=-1) + 1).tolist()
        if k:
            top_values, top_ids = logprobs.topk(k, dim=-1)
            values, ids = top_values.tolist(), top_ids.tolist()
        else:
            values, ids = [[] for _ in ranks], [[] for _ in ranks]
        for token, value, rank, top_v, top_i in zip(
            chosen.view(-1).tolist(), chosen_lp.view(-1).tolist(), ranks, values, ids, strict=True
        ):
            out.token_ids.append([token, *top_i])
            out.logprobs.append([value, *top_v])
            out.ranks.append(int(rank))
    return out


def first_prompt_row(token_id: int) -> TokenLogprobs:
    """Prompt row 0: the first prompt token, without a value (``TokenLogprobs``' layout)."""
    return TokenLogprobs(token_ids=[[token_id]], logprobs=[[]], ranks=[0])
