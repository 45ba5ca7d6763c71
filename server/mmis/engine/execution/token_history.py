"""The token history sampling penalties need, kept on the device across steps.

Invariants:
- :class:`TokenCounts` holds, for the batch rows with a penalty, dense ``[rows, vocab]``
  output-token counts and (for a repetition penalty) a prompt mask; :class:`TokenHistoryCache`
  (owned by the runner, ``engine/execution/runner.py``) builds it from the requests' own token
  lists, updating device tensors with only the tokens appended since the previous step; a request
  the cache has not seen (or dropped: finished, preempted) is counted from its lists in full,
  so the counts always equal those of ``prompt_token_ids`` / ``output_token_ids``. Chosen over
  recounting the lists every step by measurement (``benchmarks/README.md``).
- The sampler (``engine/execution/sampler.py``) only reads a ``TokenCounts``; nothing here samples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import torch


@dataclasses.dataclass(frozen=True)
class TokenCounts:
    """The token history of the batch rows that have a penalty, on the logits' device.

    ``rows[k]`` is the batch row of history row ``k``; ``output[k, t]`` how often token ``t``
    occurs among that request's output tokens so far (float32); ``prompt[k, t]`` whether it
    occurs in its prompt (``None`` when no row in the batch has a repetition penalty).
    """

    rows: torch.Tensor
    output: torch.Tensor
    prompt: torch.Tensor | None


class TokenHistory(Protocol):
    """What the cache reads of a request (``engine/scheduling/request.py`` ``Request`` is one)."""

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...


@dataclasses.dataclass
class _Counted:
    seen: int  # output tokens counted
    prompt: bool = False  # whether its prompt row of the batch tensor is filled


class TokenHistoryCache:
    """Output-token counts and prompt masks of the requests with penalties, on the device.

    The cache holds one ``[rows, vocab]`` count tensor (and prompt mask) for the rows of the
    last step. :meth:`counts` with the same requests in the same order (the steady state of
    decoding) scatters only the tokens appended since that step into it, in place; otherwise
    it gathers the rows it still has into a new batch tensor (one index_select) and counts the
    other requests from their lists, in the same scatter. Either way the cost does not grow
    with the history's length, except for requests seen for the first time.
    """

    def __init__(self) -> None:
        self._rows: dict[str, _Counted] = {}
        self._ids: list[str] = []  # request ids of the rows of ``_output`` / ``_prompt``
        self._output: torch.Tensor | None = None
        self._prompt: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self._rows)

    def drop(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._rows.pop(request_id, None)
        if not self._rows:  # nobody left: free the batch tensors too
            self.clear()

    def clear(self) -> None:
        self._rows.clear()
        self._ids, self._output, self._prompt = [], None, None

    def counts(
        self,
        rows: Sequence[int],
        request_ids: Sequence[str],
        histories: Sequence[TokenHistory],
        *,
        with_prompt: bool,
        vocab_size: int,
        device: torch.device,
    ) -> TokenCounts:
        """The :class:`TokenCounts` of ``rows`` (ascending batch rows), whose requests are
        ``request_ids`` with token lists ``histories``."""
        ids = list(request_ids)
        old, old_prompt = self._output, self._prompt
        if old is not None and (old.shape[1] != vocab_size or old.device != device):
            old, old_prompt = None, None
        if old is not None and ids == self._ids and all(i in self._rows for i in ids):
            output, prompt = old, old_prompt  # the steady state: update in place
        else:  # new batch tensors: rows kept from the old ones, zeros for the rest
            where = {rid: k for k, rid in enumerate(self._ids)} if old is not None else {}
            kept = [(k, where[rid]) for k, rid in enumerate(ids) if rid in where]
            kept = [(k, j) for k, j in kept if ids[k] in self._rows]
            output = torch.zeros(len(ids), vocab_size, dtype=torch.float32, device=device)
            prompt = None
            if old is not None and kept:
                dst = _index([k for k, _ in kept], device)
                src = _index([j for _, j in kept], device)
                output[dst] = old.index_select(0, src)
                if old_prompt is not None:
                    prompt = torch.zeros(len(ids), vocab_size, dtype=torch.bool, device=device)
                    prompt[dst] = old_prompt.index_select(0, src)
            kept_rows = {k for k, _ in kept}
            for k, rid in enumerate(ids):
                state = self._rows.get(rid)
                if k not in kept_rows or state is None:
                    self._rows[rid] = _Counted(0)
                elif prompt is None:
                    state.prompt = False
        new_rows: list[int] = []
        new_tokens: list[int] = []
        for k, (rid, history) in enumerate(zip(ids, histories, strict=True)):
            state = self._rows[rid]
            out = history.output_token_ids
            if state.seen > len(out):  # cannot happen (tokens are only appended): recount
                output[k].zero_()
                state.seen = 0
            appended = out[state.seen :]
            new_rows.extend([k] * len(appended))
            new_tokens.extend(appended)
            state.seen = len(out)
        if new_tokens:
            index = torch.tensor([new_rows, new_tokens], dtype=torch.long).to(device)
            output.index_put_((index[0], index[1]), torch.ones((), device=device), accumulate=True)
        if with_prompt:
            prompt = self._fill_prompts(ids, histories, prompt, vocab_size, device)
        self._ids, self._output, self._prompt = ids, output, prompt
        return TokenCounts(_index(list(rows), device), output, prompt if with_prompt else None)

    def _fill_prompts(
        self,
        ids: Sequence[str],
        histories: Sequence[TokenHistory],
        prompt: torch.Tensor | None,
        vocab_size: int,
        device: torch.device,
    ) -> torch.Tensor:
        if prompt is None:
            prompt = torch.zeros(len(ids), vocab_size, dtype=torch.bool, device=device)
            for rid in ids:
                self._rows[rid].prompt = False
        flat_rows: list[int] = []
        flat_tokens: list[int] = []
        for k, rid in enumerate(ids):
            state = self._rows[rid]
            if not state.prompt:
                tokens = histories[k].prompt_token_ids
                flat_rows.extend([k] * len(tokens))
                flat_tokens.extend(tokens)
                state.prompt = True
        if flat_tokens:
            index = torch.tensor([flat_rows, flat_tokens], dtype=torch.long).to(device)
            prompt[index[0], index[1]] = True
        return prompt


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device)
