"""Admission checks of P1: can this (already resolved) request run at all?

Invariants:
- Every problem a client can put in a request -- token ids outside the vocabulary, ``n != 1``
  (P0 owns the choices: one engine request per choice), sampling/pooling parameters out of
  range (``logit_bias`` token ids outside the vocabulary included: the one place they are
  checked), a prompt plus ``max_tokens`` beyond the context,
  placeholder ranges outside the prompt, item tensors that do not match their placeholder --
  is found here, before the request reaches the scheduler, and named in a typed
  :class:`Problem` (an :class:`ErrorCode` and a message a client can act on).
- Pure: reads the request (each item's ``data`` holds its resolved tensors,
  ``engine/core_process.py``) and the model's limits; changes nothing.
- Never raises for bad input: a check that trips over malformed tensors reports a problem.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

from mmis.engine.scheduling.sampling_params import validate as validate_sampling
from mmis.protocol.encoder import MM_EMBEDS
from mmis.protocol.errors import MMISError
from mmis.protocol.messages import EngineCoreRequest, ErrorCode

POOLING_TYPES = ("mean", "last")


class PlaceholderCounter(Protocol):
    def num_placeholder_tokens(self, item: Mapping[str, Any]) -> int: ...


@dataclasses.dataclass(frozen=True)
class Problem:
    code: ErrorCode
    message: str


@dataclasses.dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int | None = None


def check_request(
    request: EngineCoreRequest,
    limits: ModelLimits,
    adapter: PlaceholderCounter | None = None,
) -> Problem | None:
    """The first problem that keeps ``request`` from ever running, or ``None``."""
    return (
        _check_tokens(request, limits)
        or _check_params(request, limits.vocab_size)
        or _check_items(request, adapter)
    )


def _check_tokens(request: EngineCoreRequest, limits: ModelLimits) -> Problem | None:
    ids = request.prompt_token_ids
    if not ids:
        return Problem(ErrorCode.INVALID_REQUEST, "the prompt is empty")
    if min(ids) < 0 or max(ids) >= limits.vocab_size:
        return Problem(
            ErrorCode.INVALID_REQUEST, f"prompt token ids must be in [0, {limits.vocab_size})"
        )
    sampling = request.sampling_params
    budget = len(ids) + (sampling.max_tokens if sampling is not None else 0)
    if limits.max_model_len is not None and budget > limits.max_model_len:
        return Problem(
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"the prompt ({len(ids)} tokens) plus max_tokens exceeds the model's context of "
            f"{limits.max_model_len} tokens",
        )
    return None


def _check_params(request: EngineCoreRequest, vocab_size: int) -> Problem | None:
    sampling, pooling = request.sampling_params, request.pooling_params
    if sampling is not None:
        if sampling.n != 1:
            return Problem(
                ErrorCode.INVALID_REQUEST,
                f"n must be 1 in the engine, got {sampling.n}: the front end sends one request "
                "per choice",
            )
        if sampling.max_tokens < 1:
            return Problem(ErrorCode.INVALID_REQUEST, "max_tokens must be at least 1")
        try:
            validate_sampling(sampling, vocab_size)  # logit_bias ids in the vocabulary too
        except MMISError as exc:
            return Problem(ErrorCode.INVALID_REQUEST, str(exc))
    if pooling is not None and pooling.pooling_type not in POOLING_TYPES:
        return Problem(
            ErrorCode.INVALID_REQUEST,
            f"pooling_type must be one of {POOLING_TYPES}, got {pooling.pooling_type!r}",
        )
    return None


def _check_items(request: EngineCoreRequest, adapter: PlaceholderCounter | None) -> Problem | None:
    num_tokens = len(request.prompt_token_ids)
    for feature in request.mm_features:
        data = feature.data if isinstance(feature.data, Mapping) else None
        offset, length = feature.placeholder.offset, feature.placeholder.length
        if offset < 0 or length < 1 or offset + length > num_tokens:
            return Problem(
                ErrorCode.INVALID_REQUEST,
                f"item {feature.mm_hash}: placeholder [{offset}, {offset + length}) is outside "
                f"the prompt of {num_tokens} tokens",
            )
        if adapter is None or data is None:
            continue
        try:
            expected = adapter.num_placeholder_tokens(data)
        except (MMISError, ValueError, TypeError, RuntimeError) as exc:
            if MM_EMBEDS in data:  # an encoder output's rows were checked against the
                continue  # placeholder (engine/encoder_inputs.py); no pixels to count from
            return Problem(ErrorCode.INVALID_REQUEST, f"item {feature.mm_hash}: {exc}")
        if expected != length:
            return Problem(
                ErrorCode.INVALID_REQUEST,
                f"item {feature.mm_hash}: its tensors expand to {expected} placeholder tokens, "
                f"the prompt has {length}",
            )
    return None
