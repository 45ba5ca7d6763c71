"""One scheduling step as data: what the scheduler hands the model runner, and what comes back.

The scheduler (``scheduler.py``) builds a :class:`SchedulerOutput`; the runner (``runner.py``)
reads it as is and answers with a :class:`StepOutput`; the scheduler turns that into the
wire's ``EngineCoreOutput`` s. Pure data: nothing here runs a model or imports torch.

Invariants:
- Each request appears at most once in ``scheduled``; the runner computes all of them in ONE
  forward pass, packed in this order.
- For every :class:`ScheduledRequest`, ``start_position`` tokens are already in the KV cache;
  ``token_ids`` are computed now at positions ``[start_position, start_position +
  len(token_ids))``, and ``block_table`` has a block for each of them (slot of position ``p``
  = ``block_table[p // block_size] * block_size + p % block_size``); block 0 never appears.
- ``mm_items`` lists the request's items placed before the end of the chunk. ``data`` carries
  tensors only for the items the runner encodes this step (``encoder_inputs``, indexes into
  ``mm_items``: not cached, reached by this chunk); every other item's embeddings are in the
  runner's store. An item's ``grid_thw`` is parsed once, when :class:`MultiModalInput` is
  built from tensors, and survives dropping them (M-RoPE needs it either way).
- ``freed_encoder_hashes`` lists encoder outputs the runner may drop *before* it runs this
  step's encoders; a hash used by this step never appears there.
- ``finished_request_ids`` (finished, aborted or rejected since the previous pass; ids the
  runner never saw may appear) and ``preempted_request_ids`` (lost their KV this pass; they
  come back later with ``is_new=True``) together are ``ended_request_ids``: the runner drops
  their per-request state.
- Async scheduling (``engine/core.py``): a step may be scheduled while the previous one
  (``step - 1``) is still in flight. A row whose last token is the token that step samples
  for the same request (its *placeholder*, not on the host yet) is listed in ``pending_rows``
  (indexes into ``scheduled``; such a row is one decode token) with ``pending_sources``, the
  index of that token among step ``step - 1``'s sampled rows; its ``token_ids`` hold
  :data:`PLACEHOLDER_TOKEN` there, which the runner replaces on the device from the previous
  step's sampled ids (never read as a token on the host). ``needs_update_first``: a row of
  this step samples for a request that is not ``Request.overlappable``; the next pass must
  wait for this step's update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from mmis.protocol.errors import MMISError
from mmis.protocol.messages import PoolingParams, SamplingParams, TokenLogprobs

GREEDY_EPSILON = 1e-5  # a temperature below it means greedy (``sampler.py``)
# a scheduled token that the previous step is still sampling (async scheduling); not a token id
PLACEHOLDER_TOKEN = -1
_IDENTITIES: dict[int, list[int]] = {}


def identity(count: int) -> list[int]:
    """``list(range(count))``, one shared list per count (read only): async scheduling's
    steady-state ``pending_rows`` / ``pending_sources``, which the runner recognises by
    identity."""
    ident = _IDENTITIES.get(count)
    if ident is None:
        ident = _IDENTITIES[count] = list(range(count))
    return ident


def is_plain(params: SamplingParams | None, pooling: PoolingParams | None) -> bool:
    """Whether a request's rows need nothing from the runner but a draw: valid
    temperature/top-p/top-k, no logit bias, penalty, ``min_p``, grammar, logprobs or prompt
    logprobs, not pooling. Decided once per request (``Request.plain``); a step of plain rows
    skips the runner's and the sampler's per-row checks (``runner.py``, ``sampler.py``)."""
    return (
        pooling is None
        and params is not None
        and params.temperature >= 0
        and 0 < params.top_p <= 1
        and params.top_k >= -1
        and params.presence_penalty == 0
        and params.frequency_penalty == 0
        and params.repetition_penalty == 1
        and params.min_p == 0
        and not params.logit_bias
        and params.structured is None
        and params.logprobs is None
        and params.prompt_logprobs is None
    )


class EncoderInputError(MMISError):
    """An encoder run was scheduled for an item whose tensors are not in memory."""


def grid_thw_of(data: object) -> tuple[int, int, int] | None:
    """The (t, h, w) patch grid in an item's tensors (``image_grid_thw`` of an image,
    ``video_grid_thw`` of a video), if any."""
    if not isinstance(data, Mapping):
        return None
    grid = data.get("image_grid_thw")
    if grid is None:
        grid = data.get("video_grid_thw")
    if grid is None:
        return None
    values = [int(v) for v in grid.reshape(-1).tolist()]
    return (values[0], values[1], values[2]) if len(values) == 3 else None


def second_per_grid_of(data: object) -> float | None:
    """A video's seconds per temporal patch (Qwen2.5-VL's ``second_per_grid_ts``), if given."""
    if not isinstance(data, Mapping):
        return None
    seconds = data.get("second_per_grid_ts")
    if seconds is None:
        return None
    flat = seconds.reshape(-1).tolist() if hasattr(seconds, "reshape") else seconds
    values = flat if isinstance(flat, list | tuple) else [flat]
    return float(values[0]) if len(values) == 1 else None


@dataclasses.dataclass(frozen=True, slots=True)
class MultiModalInput:
    """One multimodal item of a scheduled request."""

    mm_hash: str
    offset: int  # first placeholder token's index in the prompt
    length: int  # number of placeholder tokens
    data: Mapping[str, Any] | None = None  # processor tensors, when encoding this step
    # (t, h, w) patch grid (Qwen2-VL M-RoPE); taken from ``data`` when not given, so
    # ``dataclasses.replace(item, data=None)`` keeps it
    grid_thw: tuple[int, int, int] | None = None
    # a video's seconds per temporal patch (Qwen2.5-VL M-RoPE), kept the same way
    second_per_grid: float | None = None

    def __post_init__(self) -> None:
        if self.grid_thw is None and self.data is not None:
            object.__setattr__(self, "grid_thw", grid_thw_of(self.data))
        if self.second_per_grid is None and self.data is not None:
            object.__setattr__(self, "second_per_grid", second_per_grid_of(self.data))

    @property
    def end(self) -> int:
        return self.offset + self.length


class ScheduledRequest(NamedTuple):
    """One request's work in a step; immutable. A named tuple: the scheduler builds one per
    running request per step with ``tuple.__new__`` (half a dataclass's ``__init__``) and the
    runner takes its columns with one ``zip(*rows)`` (``benchmarks/bench_host_step.py``).
    ``block_table`` is the KV manager's persistent list of the request (``kv_cache.py``): it
    may gain ids in later steps, never changes those it has."""

    request_id: str
    token_ids: Sequence[int]  # the chunk to compute this step
    start_position: int  # == the request's num_computed_tokens before this step
    block_table: Sequence[int]
    mm_items: Sequence[MultiModalInput] = ()
    sample: bool = True  # this chunk reaches the last known token: sample (or pool) after it
    sampling_params: SamplingParams | None = None  # None: greedy
    pooling_params: PoolingParams | None = None  # set for pooling (embedding) requests
    is_new: bool = False  # first step since admission (or re-admission after preemption)
    encoder_inputs: Sequence[int] = ()  # indexes into mm_items: encode these this step
    plain: bool = False  # ``is_plain`` of the params (False: the runner checks the row)
    lora_name: str | None = None  # the LoRA adapter of every row (engine/lora/); None: base

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_position(self) -> int:
        return self.start_position + len(self.token_ids)

    def check_encoder_inputs(self) -> None:
        """Raise :class:`EncoderInputError` if an item to encode carries no tensors."""
        for idx in self.encoder_inputs:
            item = self.mm_items[idx]
            if item.data is None:
                raise EncoderInputError(
                    f"request {self.request_id!r}: item {item.mm_hash!r} must be encoded "
                    "but carries no tensors"
                )


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """Everything the runner needs for one step."""

    scheduled: Sequence[ScheduledRequest]
    freed_encoder_hashes: Sequence[str] = ()
    finished_request_ids: Sequence[str] = ()
    preempted_request_ids: Sequence[str] = ()
    step: int = 0
    # async scheduling (see the module docstring): rows whose last token is a placeholder, the
    # previous step's sampled row of each, and whether the next pass must follow the update
    pending_rows: Sequence[int] = ()
    pending_sources: Sequence[int] = ()
    needs_update_first: bool = False

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def ended_request_ids(self) -> list[str]:
        """Requests whose per-request runner state is dropped (a preempted one restarts)."""
        return [*self.finished_request_ids, *self.preempted_request_ids]


@dataclasses.dataclass
class StepOutput:
    """What one step produced: ``sampled`` holds one token per sampled row (a chunk with
    ``sample`` set and no ``pooling_params``), in schedule order, for the rows'
    ``sampled_ids``; the rest is keyed by request id."""

    sampled: list[int] = dataclasses.field(default_factory=list)
    sampled_ids: Sequence[str] = ()
    logprobs: dict[str, TokenLogprobs] = dataclasses.field(default_factory=dict)  # who asked
    # prompt logprobs of this chunk: request id -> (index of the first prompt token scored,
    # one row per prompt token from there; ``engine/execution/logprobs.py`` ``score``)
    prompt_logprobs: dict[str, tuple[int, TokenLogprobs]] = dataclasses.field(default_factory=dict)
    pooled: dict[str, Any] = dataclasses.field(default_factory=dict)  # numpy float32 vectors
    encoded_mm_hashes: list[str] = dataclasses.field(default_factory=list)

    @property
    def sampled_token_ids(self) -> dict[str, int]:
        """``sampled`` by request id (for readers that look tokens up one at a time)."""
        return dict(zip(self.sampled_ids, self.sampled, strict=True))
