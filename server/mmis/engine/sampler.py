"""Batched token sampling: greedy, temperature, top-k, top-p and per-request seeds.

Invariants:
- ``temperature`` below :data:`GREEDY_EPSILON` (or no params at all) means greedy: the argmax of
  the raw logits, exactly as ``generate(do_sample=False)`` picks it.
- One batched pass for all rows: top-k and top-p share one sort; sampling is an exponential
  race (``argmax(p / q)``, ``q ~ Exp(1)``), which draws from ``p`` exactly.
- A seeded row draws its noise from a generator seeded by ``(seed, position)``: the token at
  a given position of a seeded request is the same whatever the batch around it, however the
  prompt was chunked, and after a preemption that recomputes it. No state is kept.
- Invalid parameters raise :class:`SamplingParamsError`, never an assert.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmis.protocol.errors import MMISError
from mmis.protocol.messages import ErrorCode, SamplingParams

GREEDY_EPSILON = 1e-5
_SEED_MIX = 0x9E3779B97F4A7C15
_MASK64 = (1 << 63) - 1


class SamplingParamsError(MMISError, ValueError):
    """Sampling parameters out of range."""

    code = ErrorCode.INVALID_REQUEST.value


def validate(params: SamplingParams) -> None:
    if params.temperature < 0:
        raise SamplingParamsError(f"temperature must be >= 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise SamplingParamsError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k < -1:
        raise SamplingParamsError(f"top_k must be -1, 0 (off) or positive, got {params.top_k}")


def is_greedy(params: SamplingParams | None) -> bool:
    return params is None or params.temperature < GREEDY_EPSILON


def seed_for(seed: int, position: int) -> int:
    """A generator seed for the token sampled at ``position`` of a request seeded ``seed``."""
    return ((seed & _MASK64) * _SEED_MIX + position * 0x2545F4914F6CDD1D + 1) & _MASK64


class Sampler:
    """Turns a ``[S, V]`` logits batch into ``S`` token ids."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams | None],
        positions: Sequence[int],
    ) -> torch.Tensor:
        """``positions[i]``: the index the sampled token of row i will have in its sequence."""
        if logits.ndim != 2 or logits.shape[0] != len(params) or len(params) != len(positions):
            raise SamplingParamsError(
                f"logits {tuple(logits.shape)} do not match {len(params)} params / "
                f"{len(positions)} positions"
            )
        for p in params:
            if p is not None:
                validate(p)
        logits = logits.float()
        greedy_rows = [is_greedy(p) for p in params]
        argmax = logits.argmax(dim=-1)
        if all(greedy_rows):
            return argmax
        probs = self._probabilities(logits, params)
        noise = torch.empty_like(probs).exponential_()
        for i, p in enumerate(params):
            if p is not None and p.seed is not None and not greedy_rows[i]:
                gen = torch.Generator(device=probs.device).manual_seed(
                    seed_for(p.seed, positions[i])
                )
                noise[i].exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        greedy = torch.tensor(greedy_rows, device=logits.device)
        return torch.where(greedy, argmax, sampled)

    @staticmethod
    def _probabilities(
        logits: torch.Tensor, params: Sequence[SamplingParams | None]
    ) -> torch.Tensor:
        vocab = logits.shape[-1]
        temps, top_k, top_p = [], [], []
        for p in params:
            sampling = p is not None and p.temperature >= GREEDY_EPSILON
            temps.append(p.temperature if p is not None and sampling else 1.0)
            k = p.top_k if p is not None else 0
            top_k.append(k if 0 < k < vocab else vocab)
            top_p.append(p.top_p if p is not None and p.top_p < 1.0 else float("inf"))
        device = logits.device
        scaled = logits / torch.tensor(temps, device=device).unsqueeze(1)
        if min(top_k) == vocab and min(top_p) == float("inf"):
            return torch.softmax(scaled, dim=-1)
        ordered, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device).unsqueeze(0)
        drop = rank >= torch.tensor(top_k, device=device).unsqueeze(1)
        ordered = ordered.masked_fill(drop, float("-inf"))
        sorted_probs = torch.softmax(ordered, dim=-1)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
        drop = before >= torch.tensor(top_p, device=device).unsqueeze(1)
        drop[:, 0] = False  # always keep the most likely token
        ordered = ordered.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(scaled, float("-inf")).scatter(-1, order, ordered)
        return torch.softmax(filtered, dim=-1)
