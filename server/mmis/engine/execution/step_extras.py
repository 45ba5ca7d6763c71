"""A step's outputs besides its sampled ids, for the rows that ask (the runner's ``extras``,
``runner.py``): prompt logprobs and pooled vectors.

Invariants:
- Prompt logprobs (``SamplingParams.prompt_logprobs``): for a request that has no output
  token yet, the logits of every scheduled row before the prompt's last token score the NEXT
  prompt token (read from ``histories``: a chunk's last row scores the first token of the
  next chunk), in ``StepOutput.prompt_logprobs`` as (first position, rows); the core joins
  the chunks (``engine/core.py``).
- Pooling (``PoolingParams``): ``last`` is the hidden row of the prompt's last token;
  ``mean`` the mean of every prompt row, summed over the request's chunks. The partial sum of
  a mean-pooling request whose prompt spans several chunks is the only state kept, dropped
  when the request ends (:meth:`StepExtras.drop`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from mmis.engine.execution import logprobs
from mmis.engine.execution.model.adapter import ModelAdapter
from mmis.engine.execution.step_errors import StepInputError
from mmis.engine.execution.token_history import TokenHistory
from mmis.engine.scheduling.sched_output import ScheduledRequest, StepOutput


class StepExtras:
    def __init__(self, adapter: ModelAdapter) -> None:
        self.adapter = adapter
        # mean pooling across chunks: request id -> (sum of its rows so far, their count)
        self.partial_sums: dict[str, tuple[torch.Tensor, int]] = {}

    def drop(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.partial_sums.pop(request_id, None)

    def run(
        self,
        hidden: torch.Tensor,
        seqs: Sequence[ScheduledRequest],
        out: StepOutput,
        histories: Mapping[str, TokenHistory] | None,
    ) -> None:
        """Fill ``out``'s prompt logprobs and pooled vectors (``hidden``: every packed row)."""
        self._prompt_logprobs(hidden, seqs, out, histories)
        self._pool(hidden, seqs, out)

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor,
        seqs: Sequence[ScheduledRequest],
        out: StepOutput,
        histories: Mapping[str, TokenHistory] | None,
    ) -> None:
        offset = 0
        for s in seqs:
            base, offset = offset, offset + s.num_tokens
            params = s.sampling_params
            if params is None or params.prompt_logprobs is None or s.pooling_params is not None:
                continue
            request = None if histories is None else histories.get(s.request_id)
            if request is None:
                raise StepInputError(f"request {s.request_id}: prompt logprobs need its prompt")
            if request.output_token_ids:  # sent with the first output already
                continue
            prompt = request.prompt_token_ids
            end = min(s.end_position, len(prompt) - 1)  # rows before the last prompt token
            lp = logprobs.first_prompt_row(prompt[0]) if s.start_position == 0 else None
            if end > s.start_position:
                logits = self.adapter.compute_logits(hidden[base : base + end - s.start_position])
                rows = logprobs.score(
                    logits, prompt[s.start_position + 1 : end + 1], params.prompt_logprobs
                )
                if lp is None:
                    lp = rows
                else:
                    lp.token_ids.extend(rows.token_ids)
                    lp.logprobs.extend(rows.logprobs)
                    lp.ranks.extend(rows.ranks)
            if lp is not None:
                out.prompt_logprobs[s.request_id] = (
                    0 if s.start_position == 0 else s.start_position + 1,
                    lp,
                )

    def _pool(
        self, hidden: torch.Tensor, seqs: Sequence[ScheduledRequest], out: StepOutput
    ) -> None:
        offset = 0
        for s in seqs:
            rows = hidden[offset : offset + s.num_tokens].float()
            offset += s.num_tokens
            params = s.pooling_params
            if params is None:
                continue
            if params.pooling_type == "last":
                vector = rows[-1] if s.sample else None
            elif params.pooling_type == "mean":
                vector = self._mean(s, rows)
            else:
                raise StepInputError(f"unknown pooling_type {params.pooling_type!r}")
            if vector is None:
                continue
            if params.normalize:
                vector = torch.nn.functional.normalize(vector, dim=-1)
            out.pooled[s.request_id] = vector.cpu().numpy().astype(np.float32)

    def _mean(self, s: ScheduledRequest, rows: torch.Tensor) -> torch.Tensor | None:
        total, count = self.partial_sums.pop(s.request_id, (None, 0))
        if total is None and s.start_position != 0:
            raise StepInputError(
                f"request {s.request_id}: mean pooling needs every prompt token computed "
                "(start at 0; no prefix-cache hit)"
            )
        total = rows.sum(dim=0) if total is None else total + rows.sum(dim=0)
        count += rows.shape[0]
        if not s.sample:
            self.partial_sums[s.request_id] = (total, count)
            return None
        return total / count
