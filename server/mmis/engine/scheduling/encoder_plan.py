"""One chunk's multimodal plan: how far the chunk may go and which encoder runs it brings.

The scheduler (``engine/scheduling/scheduler.py``) proposes tokens ``[start, start + num_new)`` of a
request; :func:`plan_chunk` trims that range around the request's items and reserves the
encoder-cache slots of the items it first reaches; :func:`rollback` undoes the reservations
of a chunk that is not scheduled after all.

Invariants:
- An item's encoder run is planned only by the chunk that first reaches its placeholder range
  while its output is not cached, and it encodes the whole item (into the encoder cache), so
  that chunk and the later ones may split the range anywhere.
- An item that does not fit the step's encoder budget or the cache's free slots makes the
  chunk stop before it (or schedule nothing).
- With ``SchedulerConfig.whole_mm_spans`` (an adapter whose item tokens attend to each other
  both ways, Gemma 3) a chunk never ends strictly inside an item: it stops before the item,
  or, started inside one (a prefix hit), schedules nothing until the rest fits one step.
- Every encoder-cache change a plan makes is recorded in it (``allocated``, ``acquired``),
  so :func:`rollback` restores the cache exactly.
- Importable and runnable without torch.
"""

from __future__ import annotations

import dataclasses

from mmis.engine.scheduling.encoder_cache import EncoderCacheManager
from mmis.engine.scheduling.request import Request
from mmis.engine.scheduling.sched_config import SchedulerConfig


@dataclasses.dataclass
class Budget:
    """What is left of one step: tokens and placeholder tokens to encode."""

    tokens: int
    encoder: int


@dataclasses.dataclass
class EncoderPlan:
    """One chunk's encoder runs, and every encoder-cache change made for them this pass."""

    num_new_tokens: int
    encoder_inputs: list[int] = dataclasses.field(default_factory=list)  # mm_features indexes
    allocated: list[str] = dataclasses.field(default_factory=list)  # new entries, this pass
    acquired: list[str] = dataclasses.field(default_factory=list)  # new references, this pass
    encoder_tokens: int = 0


def plan_chunk(
    cache: EncoderCacheManager,
    config: SchedulerConfig,
    request: Request,
    start: int,
    num_new: int,
    budget: Budget,
) -> EncoderPlan:
    """Trim tokens ``[start, start + num_new)`` of ``request`` and reserve its encoder runs."""
    plan = EncoderPlan(num_new)
    features = request.mm_features
    if not features:
        return plan
    rid, end = request.request_id, start + num_new
    if config.whole_mm_spans:
        for feature in features:
            lo, length = feature.placeholder.offset, feature.placeholder.length
            if lo < end < lo + length:  # would end inside the item
                end = lo if lo >= start else start
    for idx in sorted(range(len(features)), key=lambda i: features[i].placeholder.offset):
        feature = features[idx]
        offset, length = feature.placeholder.offset, feature.placeholder.length
        if offset >= end:
            break
        if offset + length <= start:
            continue
        key = request.mm_items[idx].mm_hash  # the encoder-cache key (with a tower adapter's id)
        held = rid in cache.refs(key)
        if cache.acquire(rid, key):
            if not held:
                plan.acquired.append(key)
            continue
        fits = plan.encoder_tokens + length <= budget.encoder and cache.can_allocate(length)
        if not fits:
            end = max(offset, start)  # stop before the item (or schedule nothing)
            break
        cache.allocate(rid, key, length)
        plan.allocated.append(key)
        plan.encoder_inputs.append(idx)
        plan.encoder_tokens += length
    plan.num_new_tokens = end - start
    return plan


def rollback(cache: EncoderCacheManager, request: Request, plan: EncoderPlan) -> None:
    """Undo ``plan`` (its chunk will not be scheduled in this pass)."""
    for mm_hash in plan.allocated:
        cache.cancel(request.request_id, mm_hash)
    for mm_hash in plan.acquired:
        cache.release(request.request_id, mm_hash)
