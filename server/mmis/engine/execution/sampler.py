"""Batched token sampling: logit bias, penalties, structured-output masks, greedy, temperature,
min-p, top-k, top-p and per-request seeds.

Order per row (vLLM's): ``logit_bias`` is added; then the repetition penalty (prompt and
output tokens: a positive logit is divided by it, a negative one multiplied), the frequency
penalty (times each token's count in the output so far) and the presence penalty (once per
token present in the output) are subtracted, as OpenAI defines them; a row with a
structured-output constraint then has every token its grammar disallows set to ``-inf``
(``engine/execution/structured.py``, :attr:`Sampler.grammar`); greedy rows take the
argmax of these logits; sampled rows then divide by the temperature, drop tokens below
``min_p`` times the best token's probability, then apply top-k and top-p.

Invariants:
- ``temperature`` below :data:`GREEDY_EPSILON` (or no params at all) means greedy: the argmax of
  the (biased, penalized) logits; with no bias and no penalty that is the argmax of the raw
  logits, exactly as ``generate(do_sample=False)`` picks it. Greedy is deterministic.
- One batched pass for all rows, on the logits' device: bias and penalties are a scatter and a
  few elementwise ops over ``[rows, vocab]`` tensors (no Python loop over the vocabulary, no
  device-to-host sync); top-k and top-p share one sort; sampling is an exponential race
  (``argmax(p / q)``, ``q ~ Exp(1)``), which draws from ``p`` exactly.
- Fast path: a batch where no row has a bias, a penalty or ``min_p`` runs none of that code;
  its only extra cost is five attribute checks per row (measured: ``benchmarks/bench_sampler.py``).
- The argmax (greedy, and the exponential race) picks the first maximum of a row, NaN
  counting as the maximum, on every device; on CPU it runs in numpy (:func:`_argmax`).
- A seeded row draws its noise from a generator seeded by ``(seed, position)``, and its
  penalties depend only on its own token history: the token at a given position of a seeded
  request is the same whatever the batch around it, however the prompt was chunked, and after
  a preemption that recomputes it.
- The token history a penalty needs is a ``TokenCounts`` (``engine/execution/token_history.py``).
- Invalid parameters raise :class:`SamplingParamsError`, never an assert; the message starts
  with the field's name.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from mmis.engine.execution.token_history import TokenCounts
from mmis.engine.scheduling.sampling_params import (  # the checks admission also runs
    SamplingParamsError,
    _check_basic,
    _check_extras,
)
from mmis.engine.scheduling.sched_output import GREEDY_EPSILON
from mmis.protocol.messages import SamplingParams

if TYPE_CHECKING:
    from mmis.engine.execution.structured import GrammarEngine

_SEED_MIX = 0x9E3779B97F4A7C15
_TEMPERATURE = operator.attrgetter("temperature")
_MASK64 = (1 << 63) - 1


def needs_history(params: SamplingParams | None) -> bool:
    """Whether the row's logits depend on the tokens seen so far (a penalty is on)."""
    return params is not None and (
        params.presence_penalty != 0
        or params.frequency_penalty != 0
        or params.repetition_penalty != 1
    )


def _adjusts(params: SamplingParams | None) -> bool:
    """Whether the row's logits change before the greedy pick (bias or penalty)."""
    return params is not None and (bool(params.logit_bias) or needs_history(params))


def seed_for(seed: int, position: int) -> int:
    """A generator seed for the token sampled at ``position`` of a request seeded ``seed``."""
    return ((seed & _MASK64) * _SEED_MIX + position * 0x2545F4914F6CDD1D + 1) & _MASK64


def _argmax(rows: torch.Tensor) -> torch.Tensor:
    """``rows.argmax(dim=-1)``, the same indices (the first maximum of a row; a NaN counts
    as the maximum, as in torch): numpy's on a CPU float32 tensor (no copy), ~10x faster
    than torch's there (217 vs 20 us for 256 x 448, 23.7 vs 1.5 ms for 256 x 32000 on one
    thread; ``benchmarks/README.md``, issue 31)."""
    cpu = rows.device.type == "cpu" and not rows.requires_grad
    if cpu and rows.dtype == torch.float32 and rows.ndim == 2:
        return torch.from_numpy(np.argmax(rows.numpy(), axis=-1).astype(np.int64, copy=False))
    return rows.argmax(dim=-1)


def _check_rows(
    params: Sequence[SamplingParams | None], vocab: int
) -> tuple[list[bool], bool, bool]:
    """Validate every row (raising the first problem); returns which rows are greedy, whether
    any row's logits are adjusted (bias, penalty) and whether any is constrained (a grammar)."""
    adjusted = constrained = False
    greedy_rows = []
    for p in params:
        if p is None:
            greedy_rows.append(True)
            continue
        temperature = p.temperature
        greedy_rows.append(temperature < GREEDY_EPSILON)
        if not (temperature >= 0 and 0 < p.top_p <= 1 and p.top_k >= -1):
            _check_basic(p)  # raises the first problem
        if p.structured is not None:
            constrained = True
        if not (  # no bias, penalty or min-p: the fast path
            p.presence_penalty != 0
            or p.frequency_penalty != 0
            or p.repetition_penalty != 1
            or p.min_p != 0
            or p.logit_bias
        ):
            continue
        _check_extras(p)
        if p.logit_bias and not 0 <= min(p.logit_bias) <= max(p.logit_bias) < vocab:
            raise SamplingParamsError(
                f"logit_bias: token ids must be in the vocabulary [0, {vocab})"
            )
        adjusted = adjusted or _adjusts(p)
    return greedy_rows, adjusted, constrained


class Sampler:
    """Turns a ``[S, V]`` logits batch into ``S`` token ids; ``grammar`` masks the rows whose
    params carry ``structured`` (set by the core; without it such a row is an error)."""

    def __init__(self, grammar: GrammarEngine | None = None) -> None:
        self.grammar = grammar

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams | None],
        positions: Sequence[int],
        counts: TokenCounts | None = None,
        *,
        plain: bool = False,
    ) -> torch.Tensor:
        """``positions[i]``: the index the sampled token of row i will have in its sequence;
        ``counts``: the token history of the rows that have a penalty (required then);
        ``plain``: every row's params are ``sched_output.is_plain`` (decided once per
        request), so the per-row checks are skipped: each row is an argmax or a draw."""
        if logits.ndim != 2 or logits.shape[0] != len(params) or len(params) != len(positions):
            raise SamplingParamsError(
                f"logits {tuple(logits.shape)} do not match {len(params)} params / "
                f"{len(positions)} positions"
            )
        if plain:
            if max(map(_TEMPERATURE, params), default=0.0) < GREEDY_EPSILON:  # every row greedy
                return _argmax(logits.float())
            greedy_rows = [t < GREEDY_EPSILON for t in map(_TEMPERATURE, params)]
            adjusted = constrained = False
        else:
            greedy_rows, adjusted, constrained = _check_rows(params, logits.shape[-1])
        logits = logits.float()
        if adjusted:
            logits = self._bias_and_penalize(logits, params, counts)
        if constrained and self.grammar is None:
            raise SamplingParamsError("structured: this engine has no grammar engine")
        if constrained and self.grammar is not None:
            logits = self.grammar.apply(logits, params)
        argmax = _argmax(logits)
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
        sampled = _argmax(probs / noise)
        greedy = torch.tensor(greedy_rows, device=logits.device)
        return torch.where(greedy, argmax, sampled)

    @staticmethod
    def _bias_and_penalize(
        logits: torch.Tensor,
        params: Sequence[SamplingParams | None],
        counts: TokenCounts | None,
    ) -> torch.Tensor:
        """The logits plus each row's bias, minus its penalties (out of place)."""
        device, original = logits.device, logits
        bias_rows: list[int] = []
        bias_tokens: list[int] = []
        bias_values: list[float] = []
        penalized: list[tuple[float, float, float]] = []
        for i, p in enumerate(params):
            if p is None:
                continue
            if p.logit_bias:
                bias_rows.extend([i] * len(p.logit_bias))
                bias_tokens.extend(p.logit_bias)
                bias_values.extend(p.logit_bias.values())
            if needs_history(p):
                penalized.append((p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
        if bias_rows:
            index = torch.tensor([bias_rows, bias_tokens], dtype=torch.long).to(device)
            values = torch.tensor(bias_values, dtype=logits.dtype).to(device)
            logits = logits.index_put((index[0], index[1]), values, accumulate=True)
        if not penalized:
            return logits
        if counts is None or counts.output.shape[0] != len(penalized):
            raise SamplingParamsError(
                f"{len(penalized)} row(s) have penalties but the token history covers "
                f"{0 if counts is None else counts.output.shape[0]}"
            )
        factors = torch.tensor(penalized, dtype=logits.dtype).to(device)
        repetition, frequency, presence = (factors[:, j : j + 1] for j in range(3))
        whole = counts.output.shape[0] == logits.shape[0]  # every row: no gather / scatter
        if whole and logits is original:
            rows = logits.clone()
        else:
            rows = logits if whole else logits.index_select(0, counts.rows)
        output = counts.output
        present = output > 0
        if any(rep != 1 for rep, _, _ in penalized):
            seen = present if counts.prompt is None else present | counts.prompt
            one = torch.ones((), dtype=rows.dtype, device=device)
            factor = torch.where(rows > 0, 1.0 / repetition, repetition)
            rows.mul_(torch.where(seen, factor, one))
        # OpenAI: mu[j] -= c[j] * frequency + (c[j] > 0) * presence
        zero = torch.zeros((), dtype=rows.dtype, device=device)
        rows.sub_(torch.where(present, torch.addcmul(presence, output, frequency), zero))
        return rows if whole else logits.index_copy(0, counts.rows, rows)

    @staticmethod
    def _probabilities(
        logits: torch.Tensor, params: Sequence[SamplingParams | None]
    ) -> torch.Tensor:
        vocab = logits.shape[-1]
        temps, top_k, top_p, min_p = [], [], [], []
        for p in params:
            sampling = p is not None and p.temperature >= GREEDY_EPSILON
            temps.append(p.temperature if p is not None and sampling else 1.0)
            k = p.top_k if p is not None else 0
            top_k.append(k if 0 < k < vocab else vocab)
            top_p.append(p.top_p if p is not None and p.top_p < 1.0 else float("inf"))
            min_p.append(p.min_p if p is not None and sampling else 0.0)
        device = logits.device
        scaled = logits / torch.tensor(temps, device=device).unsqueeze(1)
        if max(min_p) > 0:
            probs = torch.softmax(scaled, dim=-1)
            floor = torch.tensor(min_p, device=device).unsqueeze(1) * probs.amax(-1, True)
            scaled = scaled.masked_fill(probs < floor, float("-inf"))
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
