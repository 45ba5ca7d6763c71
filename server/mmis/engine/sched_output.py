"""What one scheduling pass hands to the model runner, and what a step's outcome reports.

Invariants:
- For every :class:`ScheduledRequest`, ``token_ids`` are the tokens at positions
  ``[start_position, start_position + len(token_ids))`` of the request, and ``block_table``
  has a block for each of those positions (slot of position ``p`` =
  ``block_table[p // block_size] * block_size + p % block_size``); block 0 never appears.
- ``encoder_inputs`` index ``mm_features``: each names an item whose encoder output is not
  cached and whose placeholder range this chunk reaches; the runner encodes it before the
  forward and stores it under its ``mm_hash``.
- ``freed_encoder_hashes`` lists encoder outputs the runner may drop *before* it runs this
  step's encoders; a hash used by this step never appears there.
- ``finished_request_ids``: requests finished, aborted or rejected since the previous pass; the
  runner drops its per-request state (ids it never saw may appear: rejected requests).
- ``preempted_request_ids``: requests that lost their KV this pass; they come back later with
  ``is_new=True`` and a fresh block table.
- :func:`to_step_batch` is the one mapping to the runner's ``StepBatch``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mmis.engine.request import Request
from mmis.engine.step_batch import MultiModalInput, ScheduledSequence, StepBatch
from mmis.protocol.errors import MMISError
from mmis.protocol.messages import (
    EngineCoreOutput,
    FinishReason,
    MultiModalFeature,
    PoolingParams,
    RequestError,
    SamplingParams,
)


class EncoderInputError(MMISError):
    """An encoder run was scheduled for an item whose tensors are not in memory."""


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the chunk to compute this step
    start_position: int  # == the request's num_computed_tokens before this step
    block_table: list[int]
    encoder_inputs: list[int]  # indexes into mm_features
    mm_features: list[MultiModalFeature]
    sampling_params: SamplingParams | None
    pooling_params: PoolingParams | None
    is_new: bool  # first step since admission (or re-admission after preemption)
    sample: bool  # this chunk reaches the last known token: sample (or pool) after it
    num_prompt_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerOutput:
    step: int
    scheduled: list[ScheduledRequest]
    freed_encoder_hashes: list[str]
    finished_request_ids: list[str]
    preempted_request_ids: list[str]

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def get(self, request_id: str) -> ScheduledRequest | None:
        for item in self.scheduled:
            if item.request_id == request_id:
                return item
        return None


@dataclasses.dataclass(slots=True)
class RequestEvent:
    """Progress or the end of one request, as produced by ``Scheduler.update_from_output``."""

    request_id: str
    client_index: int
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: RequestError | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    @classmethod
    def from_request(cls, request: Request, new_token_ids: list[int]) -> RequestEvent:
        return cls(
            request_id=request.request_id,
            client_index=request.client_index,
            new_token_ids=new_token_ids,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            error=request.error,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_wire(self) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=self.request_id,
            new_token_ids=list(self.new_token_ids),
            finish_reason=None if self.finish_reason is None else self.finish_reason.value,
            error=self.error,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            stop_reason=self.stop_reason,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    encoder_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_rejected: int


def _grid_thw(data: Any) -> tuple[int, int, int] | None:
    """The (t, h, w) patch grid of one item, from its ``image_grid_thw`` tensor if present."""
    grid = data.get("image_grid_thw") if isinstance(data, dict) else None
    if grid is None:
        return None
    values = grid.tolist() if hasattr(grid, "tolist") else list(grid)
    if len(values) == 1 and isinstance(values[0], list):  # shape (1, 3)
        values = values[0]
    if len(values) != 3:
        return None
    return (int(values[0]), int(values[1]), int(values[2]))


def to_step_batch(out: SchedulerOutput) -> StepBatch:
    """The runner's input for ``out``: items up to the chunk's end, tensors only for the
    items whose encoder runs this step (others are in the runner's encoder store)."""
    sequences = []
    for item in out.scheduled:
        end = item.start_position + len(item.token_ids)
        encode = set(item.encoder_inputs)
        mm_items = []
        for idx, feature in enumerate(item.mm_features):
            ph = feature.placeholder
            if ph.offset >= end:
                continue
            data: dict[str, Any] | None = None
            if idx in encode:
                if not isinstance(feature.data, dict):
                    raise EncoderInputError(
                        f"request {item.request_id!r}: item {feature.mm_hash!r} must be encoded "
                        f"but carries no tensors ({type(feature.data).__name__})"
                    )
                data = feature.data
            grid = _grid_thw(feature.data)  # M-RoPE needs it whether or not we encode
            mm_items.append(MultiModalInput(feature.mm_hash, ph.offset, ph.length, data, grid))
        sequences.append(
            ScheduledSequence(
                request_id=item.request_id,
                token_ids=item.token_ids,
                start_position=item.start_position,
                block_table=item.block_table,
                mm_items=mm_items,
                sample=item.sample,
                sampling_params=item.sampling_params,
                pooling_params=item.pooling_params,
            )
        )
    # a preempted request restarts from scratch: the runner drops its state like a finished one
    ended = [*out.finished_request_ids, *out.preempted_request_ids]
    return StepBatch(sequences, out.freed_encoder_hashes, ended)
