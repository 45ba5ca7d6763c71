"""Scheduler settings: one frozen dataclass, validated on construction.

Invariants:
- Every limit is a positive integer (``max_model_len`` may be ``None``: no limit beyond the KV
  pool); a bad value raises
  :class:`~mmis.config.ConfigError` naming the field.
- User settings (``block_size``, ``enable_prefix_caching``, ``max_model_len``) default to
  :class:`EngineConfig`'s, their one definition, and the two batch limits to their fixed
  defaults (``engine/batch_limits.py``, which ``mmis engine`` resolves before building
  this); the rest are internal to the scheduler.
- ``num_blocks`` counts block 0, the reserved null block, so ``num_blocks - 1`` are usable.
- :func:`never_schedulable` names what a configuration rules out for good (a prompt beyond
  ``max_model_len``, an item larger than the encoder cache, or than a step when items are
  whole); the scheduler refuses such a request instead of queueing it forever.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from mmis.config import ConfigError, default_of
from mmis.engine.batch_limits import FIXED_MAX_NUM_BATCHED_TOKENS, FIXED_MAX_NUM_SEQS
from mmis.engine.config import MIN_ENCODER_CACHE_TOKENS, EngineConfig
from mmis.protocol.messages import ErrorCode

if TYPE_CHECKING:
    from mmis.engine.scheduling.request import Request


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = FIXED_MAX_NUM_SEQS  # running requests at most
    max_num_batched_tokens: int = FIXED_MAX_NUM_BATCHED_TOKENS  # tokens computed a step
    num_blocks: int = 1024  # KV blocks per layer, block 0 included (P1: the pool's count)
    block_size: int = default_of(EngineConfig, "block_size")  # tokens per KV block
    enable_prefix_caching: bool = default_of(EngineConfig, "enable_prefix_caching")
    encoder_cache_size: int = MIN_ENCODER_CACHE_TOKENS  # output slots, one per placeholder token
    encoder_compute_budget: int = MIN_ENCODER_CACHE_TOKENS  # placeholder tokens encoded a step
    max_model_len: int | None = default_of(EngineConfig, "max_model_len")  # prompt + output
    # an item's tokens attend to each other both ways (Gemma 3): a chunk never ends inside one
    whole_mm_spans: bool = False
    # distinct LoRA adapters among the running requests at most (engine/lora/: device slots)
    max_loras: int = default_of(EngineConfig, "max_loras")

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in ("enable_prefix_caching", "whole_mm_spans"):
                if not isinstance(value, bool):
                    raise ConfigError(f"SchedulerConfig.{field.name} must be a bool, got {value!r}")
                continue
            if value is None and field.name == "max_model_len":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(
                    f"SchedulerConfig.{field.name} must be a positive integer, got {value!r}"
                )
        if self.num_blocks < 2:
            raise ConfigError(
                f"SchedulerConfig.num_blocks must be at least 2 (block 0 is reserved), "
                f"got {self.num_blocks}"
            )


def never_schedulable(cfg: SchedulerConfig, request: Request) -> tuple[ErrorCode, str] | None:
    """Why ``request`` can never be scheduled under ``cfg`` (code, message), or ``None``.

    The KV-pool bound is checked by the scheduler when it allocates (``KVCacheManager``).
    """
    if cfg.max_model_len is not None and request.num_tokens >= cfg.max_model_len:
        return (
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"the prompt has {request.num_tokens} tokens; the model's context is "
            f"{cfg.max_model_len} tokens, including at least one generated token "
            "(--max-model-len)",
        )
    # an uncached item is encoded whole in one step, into the cache (its range may then be
    # split across chunks): it must fit both
    limit = min(cfg.encoder_cache_size, cfg.encoder_compute_budget)
    for feature in request.mm_features:
        if feature.placeholder.length > limit:
            return (
                ErrorCode.INVALID_REQUEST,
                f"multimodal item {feature.mm_hash!r} needs {feature.placeholder.length} "
                f"placeholder tokens; this engine's encoder cache holds {limit} "
                "(raise it with --encoder-cache-tokens)",
            )
        if cfg.whole_mm_spans and feature.placeholder.length > cfg.max_num_batched_tokens:
            return (
                ErrorCode.INVALID_REQUEST,
                f"multimodal item {feature.mm_hash!r} needs {feature.placeholder.length} "
                "placeholder tokens in one step (its tokens attend to each other); a step "
                f"holds {cfg.max_num_batched_tokens} (raise it with --max-num-batched-tokens)",
            )
    return None
