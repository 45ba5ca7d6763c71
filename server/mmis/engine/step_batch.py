"""The model runner's input (one scheduling step) and output types.

Invariants:
- A :class:`StepBatch` lists each scheduled sequence once; the runner computes all of them in
  ONE forward pass, packed in this order.
- ``ScheduledSequence.start_position`` tokens of the sequence are already in the KV cache;
  ``token_ids`` are computed now at positions ``start_position ..
  start_position + len(token_ids) - 1``, and ``block_table`` covers every one of those positions
  (token ``p`` lives in slot ``block_table[p // block_size] * block_size + p % block_size``).
- ``mm_items`` lists the request's multimodal items placed before the end of this chunk (the
  scheduler may simply pass all of them). Items overlapping the chunk get their embeddings
  scattered into their placeholder rows; items before it matter for M-RoPE positions only.
  ``data`` carries the processor tensors when the encoder must run this step, else ``None``
  (the runner's encoder-output store already holds the embeddings).
- Pure data: nothing here runs a model; tensors may be numpy arrays or torch tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from mmis.protocol.messages import PoolingParams, SamplingParams


@dataclasses.dataclass(frozen=True)
class MultiModalInput:
    """One multimodal item of a scheduled sequence."""

    mm_hash: str
    offset: int  # first placeholder token's index in the prompt
    length: int  # number of placeholder tokens
    data: Mapping[str, Any] | None = None  # processor tensors for this item, when encoding now
    # (t, h, w) patch grid of the item (Qwen2-VL M-RoPE). Needed even when ``data`` is None;
    # when absent it is taken from ``data["image_grid_thw"]`` at construction, so
    # ``dataclasses.replace(item, data=None)`` keeps it.
    grid_thw: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        if self.grid_thw is None and self.data is not None:
            grid = self.data.get("image_grid_thw")
            if grid is not None:
                values = tuple(int(v) for v in grid.reshape(-1).tolist())
                if len(values) == 3:
                    object.__setattr__(self, "grid_thw", values)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclasses.dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's work in a step."""

    request_id: str
    token_ids: Sequence[int]
    start_position: int
    block_table: Sequence[int]
    mm_items: Sequence[MultiModalInput] = ()
    sample: bool = True  # sample (or pool) after the last token of this chunk
    sampling_params: SamplingParams | None = None  # None: greedy
    pooling_params: PoolingParams | None = None  # set for pooling (embedding) requests

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_position(self) -> int:
        return self.start_position + len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """Everything the runner needs for one step."""

    sequences: Sequence[ScheduledSequence]
    # encoder outputs the scheduler no longer needs: drop them from the runner's store
    freed_encoder_hashes: Sequence[str] = ()
    # requests that ended (finished or aborted): drop any per-request runner state
    finished_request_ids: Sequence[str] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)


@dataclasses.dataclass
class StepOutput:
    """What one step produced, keyed by request id."""

    sampled_token_ids: dict[str, int] = dataclasses.field(default_factory=dict)
    pooled: dict[str, Any] = dataclasses.field(default_factory=dict)  # numpy float32 vectors
    encoded_mm_hashes: list[str] = dataclasses.field(default_factory=list)
