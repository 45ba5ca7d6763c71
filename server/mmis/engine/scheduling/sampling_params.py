"""Range checks of a request's sampling parameters, run at admission (``admission.py``) and
by the sampler's per-batch checks (``engine/execution/sampler.py``); torch-free, as all of
``engine/scheduling``.

Invariants: invalid parameters raise :class:`SamplingParamsError` (a typed 4xx, never an
assert), whose message starts with the field's name; the ranges are OpenAI's.
"""

from __future__ import annotations

from mmis.protocol.errors import MMISError
from mmis.protocol.messages import ErrorCode, SamplingParams

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
PENALTY_RANGE = 2.0  # presence / frequency penalty in [-2, 2] (OpenAI)
LOGIT_BIAS_RANGE = 100.0  # each bias in [-100, 100] (OpenAI)
MAX_LOGIT_BIAS = 300  # entries per request


class SamplingParamsError(MMISError, ValueError):
    """Sampling parameters out of range."""

    code = ErrorCode.INVALID_REQUEST.value


def _check_basic(params: SamplingParams) -> None:
    if not params.temperature >= 0:
        raise SamplingParamsError(f"temperature must be >= 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise SamplingParamsError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k < -1:
        raise SamplingParamsError(f"top_k must be -1, 0 (off) or positive, got {params.top_k}")


def _check_extras(params: SamplingParams) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not -PENALTY_RANGE <= value <= PENALTY_RANGE:
            raise SamplingParamsError(
                f"{name} must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}], got {value}"
            )
    if not 0 < params.repetition_penalty < float("inf"):
        raise SamplingParamsError(
            f"repetition_penalty must be > 0 (1 = off), got {params.repetition_penalty}"
        )
    if not 0 <= params.min_p <= 1:
        raise SamplingParamsError(f"min_p must be in [0, 1], got {params.min_p}")
    if params.logprobs is not None and not 0 <= params.logprobs <= MAX_LOGPROBS:
        raise SamplingParamsError(
            f"logprobs must be in [0, {MAX_LOGPROBS}] (top alternatives), got {params.logprobs}"
        )
    if len(params.logit_bias) > MAX_LOGIT_BIAS:
        raise SamplingParamsError(
            f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(params.logit_bias)}"
        )


def validate(params: SamplingParams, vocab_size: int | None = None) -> None:
    """Raise :class:`SamplingParamsError` unless every parameter is in range (and, given the
    vocabulary size, every ``logit_bias`` token id is in the vocabulary)."""
    _check_basic(params)
    _check_extras(params)
    for token, bias in params.logit_bias.items():
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            where = f"[0, {vocab_size})" if vocab_size is not None else "[0, vocabulary size)"
            raise SamplingParamsError(
                f"logit_bias: token id {token} is not in the model's vocabulary {where}"
            )
        if not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
            raise SamplingParamsError(
                f"logit_bias: the bias of token {token} must be in "
                f"[-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], got {bias}"
            )
