"""Engine-side state of one request (P1): tokens, progress, multimodal items, lifecycle.

Invariants:
- ``all_token_ids`` is always ``prompt_token_ids + output_token_ids``; output tokens are only
  ever appended through :meth:`Request.append_output_token_ids` (or its one-token form
  :meth:`Request.append_output_token`).
- ``0 <= num_computed_tokens <= num_tokens``: the KV of tokens ``[0, num_computed_tokens)``
  is (or will be, once the scheduled step ran) held in the request's KV blocks.
- Multimodal placeholder ranges lie inside the prompt and never overlap; a malformed request
  raises :class:`InvalidRequestError` at construction, before it can reach the scheduler.
- ``block_hashes[i]`` is the prefix-cache hash of full block ``i`` (see ``kv_cache``); hashes
  depend only on tokens and multimodal hashes, so they survive preemption.
- ``mm_items`` (what the runner is told about each item: hash, range, grid) is built once, at
  construction, from the features as sent; the features keep their tensors for encoder runs.
  ``mm_end`` is the end of the last item's range (0 without items).
- ``skip_cache``: the request neither reads nor writes the prefix cache (see ``kv_cache``);
  always set for a request asking for prompt logprobs, whose every prompt row must be
  computed (a cached prefix would skip rows).
- Status moves WAITING -> RUNNING -> (PREEMPTED -> RUNNING)* -> FINISHED; FINISHED is final.
- ``constraint`` (structured outputs, ``engine/execution/structured.py``): pushed every output token
  appended; the request stops (``stop``) once it is done, and ends with an error once it
  knows a token it did not allow was appended (the sampler's mask prevents that).
- Async scheduling (``engine/core.py``): a token sampled by a scheduled step whose update has
  not run yet is a *placeholder*: counted in ``num_computed_tokens`` once the next row is
  scheduled over it, never in ``all_token_ids``. A running sampling request has one pending
  exactly when ``num_computed_tokens >= num_tokens`` at a pass (the scheduler's test; the
  synchronous loop's update always leaves ``num_computed_tokens == num_tokens - 1``). It
  becomes a token only through ``append_output_token`` in the step's update, so
  ``all_token_ids`` and ``block_hashes`` only ever hold real tokens.
- :attr:`Request.overlappable`: the request's next row may be scheduled and run before its
  previous token is on the host (no penalty, which reads the token history; no grammar,
  whose mask needs the accepted token; no prompt logprobs).
- An instance has at most 29 attributes: CPython 3.11 shares one key table among the
  instances of a class only up to 29 keys; a 30th gives every request a dict of its own and
  makes each attribute access ~30% slower (the host step of ``bench_host_step.py`` measured
  ~15% slower at 30), so new per-request state goes elsewhere (the async scheduler keeps its
  own, ``scheduler.py``).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from typing import Protocol

from mmis.engine.scheduling.sampling_params import MAX_LOGPROBS
from mmis.engine.scheduling.sched_output import (
    MultiModalInput,
    grid_thw_of,
    is_plain,
    second_per_grid_of,
)
from mmis.protocol.errors import MMISError
from mmis.protocol.messages import (
    EngineCoreRequest,
    ErrorCode,
    FinishReason,
    MultiModalFeature,
    PoolingParams,
    RequestError,
    SamplingParams,
)

MAX_PROMPT_LOGPROBS = MAX_LOGPROBS  # prompt_logprobs: the same limit as logprobs


class InvalidRequestError(MMISError):
    """The request cannot be scheduled as sent (empty prompt, bad placeholder ranges, ...)."""

    code = ErrorCode.INVALID_REQUEST.value


class OutputConstraint(Protocol):
    """A request's structured-output state (``engine/execution/structured.py`` ``GrammarState``)."""

    def push(self, token_id: int) -> bool:
        """Advance by one token (perhaps applied later); ``False`` once a refusal is known."""
        ...

    def is_done(self) -> bool: ...


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


def _validate_features(features: Sequence[MultiModalFeature], num_prompt_tokens: int) -> None:
    spans = []
    for feature in features:
        offset, length = feature.placeholder.offset, feature.placeholder.length
        if offset < 0 or length <= 0 or offset + length > num_prompt_tokens:
            raise InvalidRequestError(
                f"multimodal item {feature.mm_hash!r}: placeholder range "
                f"[{offset}, {offset + length}) is outside the prompt of {num_prompt_tokens} tokens"
            )
        spans.append((offset, offset + length, feature.mm_hash))
    spans.sort()
    for (_, end, ident), (start, _, nxt) in itertools.pairwise(spans):
        if start < end:
            raise InvalidRequestError(
                f"multimodal items {ident!r} and {nxt!r} have overlapping placeholder ranges"
            )


def encoder_key(mm_hash: str, lora_id: int) -> str:
    """The encoder-cache key of an item whose encoder output LoRA adapter ``lora_id`` changes
    (``engine/lora/``: an adapter with vision-tower or projector weights)."""
    return f"{mm_hash}+lora{lora_id}"


class Request:
    """Mutable per-request state owned by the scheduler."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        mm_features: Sequence[MultiModalFeature] = (),
        sampling_params: SamplingParams | None = None,
        pooling_params: PoolingParams | None = None,
        arrival_time: float = 0.0,
        client_index: int = 0,
        eos_token_ids: Sequence[int] = (),
        skip_cache: bool = False,
        constraint: OutputConstraint | None = None,
        lora_name: str | None = None,
        lora_id: int = 0,
        lora_tower: bool = False,
    ) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError(f"request {request_id!r} has an empty prompt")
        if sampling_params is None and pooling_params is None:
            sampling_params = SamplingParams()
        if sampling_params is not None and sampling_params.max_tokens < 1:
            raise InvalidRequestError(
                f"request {request_id!r}: max_tokens must be at least 1, "
                f"got {sampling_params.max_tokens}"
            )
        _validate_features(mm_features, len(prompt_token_ids))
        prompt_logprobs = None if sampling_params is None else sampling_params.prompt_logprobs
        if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_PROMPT_LOGPROBS:
            raise InvalidRequestError(
                f"request {request_id!r}: prompt_logprobs must be in [0, {MAX_PROMPT_LOGPROBS}], "
                f"got {prompt_logprobs}"
            )
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)  # the prompt never changes
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        # tuples: never changed, and a text request's are the one empty tuple (nothing of
        # its own for a step to touch)
        self.mm_features = tuple(mm_features)
        # an adapter that changes the vision tower changes the items' encoder outputs: their
        # encoder-cache key (scheduler and runner) carries the adapter, so no output computed
        # under one adapter (or the base) is used under another
        tower_key = lora_tower and lora_name is not None and lora_id > 0
        self.mm_items = tuple(
            MultiModalInput(
                encoder_key(f.mm_hash, lora_id) if tower_key else f.mm_hash,
                f.placeholder.offset,
                f.placeholder.length,
                grid_thw=grid_thw_of(f.data),
                second_per_grid=second_per_grid_of(f.data),
            )
            for f in self.mm_features
        )
        # where the last item's placeholder range ends (0: text only); a chunk starting here
        # or later has no encoder work to plan (the scheduler's fast path)
        self.mm_end = max((item.end for item in self.mm_items), default=0)
        self.skip_cache = skip_cache or prompt_logprobs is not None
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.plain = is_plain(sampling_params, pooling_params)  # params never change
        # the LoRA adapter (engine/lora/; None: the base model), fixed for the request's life
        self.lora_name = lora_name
        self.lora_id = lora_id if lora_name is not None else 0
        self.arrival_time = arrival_time
        self.client_index = client_index
        self.eos_token_ids = frozenset(eos_token_ids)  # every end-of-sequence id of the model
        # what :meth:`check_stop` can act on, from params that never change: a token in
        # ``stop_ids`` or a length of ``length_cap`` tokens (prompt + max_tokens); a request
        # with a constraint is checked after every token (the scheduler's fast path)
        self.stop_ids: frozenset[int] = frozenset()
        self.length_cap = float("inf")
        if sampling_params is not None:
            eos = () if sampling_params.ignore_eos else self.eos_token_ids
            self.stop_ids = frozenset(eos).union(sampling_params.stop_token_ids)
            self.length_cap = len(self.prompt_token_ids) + sampling_params.max_tokens
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # tokens the KV blocks it holds have room for; kept by ``kv_cache.py`` (the
        # scheduler's room check reads it without touching the block list)
        self.kv_capacity = 0
        self.num_cached_tokens = -1  # prefix-cache hit of the first admission; -1 = not yet
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.error: RequestError | None = None
        self.seq = 0  # admission order tie-breaker, set by the scheduler
        self.constraint = constraint
        self.constraint_ok = True  # False once a token the constraint refused was appended

    @classmethod
    def from_core_request(
        cls,
        message: EngineCoreRequest,
        *,
        eos_token_ids: Sequence[int] = (),
        constraint: OutputConstraint | None = None,
        lora_tower: bool = False,
    ) -> Request:
        return cls(
            message.request_id,
            message.prompt_token_ids,
            mm_features=message.mm_features,
            sampling_params=message.sampling_params,
            pooling_params=message.pooling_params,
            arrival_time=message.arrival_time,
            client_index=message.client_index,
            eos_token_ids=eos_token_ids,
            skip_cache=message.skip_cache,
            constraint=constraint,
            lora_name=message.lora_name,
            lora_id=message.lora_id,
            lora_tower=lora_tower,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def overlappable(self) -> bool:
        """Whether the next row may run before this request's previous token is on the host
        (see the module docstring); a property: params never change, and no attribute is
        spent on it."""
        params = self.sampling_params
        return self.plain or (
            params is not None
            and params.presence_penalty == 0
            and params.frequency_penalty == 0
            and params.repetition_penalty == 1
            and params.structured is None
            and params.prompt_logprobs is None
        )

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None and self.sampling_params is None

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def priority_key(self) -> tuple[float, int]:
        """Earlier arrival = higher priority; the latest-arrived is preempted first."""
        return (self.arrival_time, self.seq)

    def append_output_token(self, token_id: int) -> None:
        """:meth:`append_output_token_ids` of one token (the scheduler's per-step call)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.constraint is not None:
            self.constraint_ok = self.constraint.push(token_id) and self.constraint_ok

    def append_output_token_ids(self, token_ids: Sequence[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if self.constraint is not None:
            for token in token_ids:
                self.constraint_ok = self.constraint.push(token) and self.constraint_ok

    def finish(
        self,
        reason: FinishReason,
        *,
        stop_reason: int | str | None = None,
        error: RequestError | None = None,
    ) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error

    def check_stop(self, last_token: int) -> bool:
        """Apply the stop conditions that need no tokenizer after ``last_token`` was appended.

        Stop *strings* are P0's job (its detokenizer matches them and aborts the request).
        """
        params = self.sampling_params
        if params is None:
            return False
        if not params.ignore_eos and last_token in self.eos_token_ids:
            self.finish(FinishReason.STOP)
            return True
        if self.constraint is not None:
            if not self.constraint_ok:
                message = "a sampled token is outside the output's structured constraint"
                self.finish(
                    FinishReason.ERROR,
                    error=RequestError(ErrorCode.INTERNAL.value, message, False),
                )
                return True
            if self.constraint.is_done():
                self.finish(FinishReason.STOP)
                return True
        if last_token in params.stop_token_ids:
            self.finish(FinishReason.STOP, stop_reason=last_token)
            return True
        if len(self.output_token_ids) >= params.max_tokens:
            self.finish(FinishReason.LENGTH)
            return True
        return False

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
