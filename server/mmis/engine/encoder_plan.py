"""Encoder planning for one request's chunk: which images to encode, where the chunk must stop.

Invariants:
- A chunk never splits the placeholder range of an item whose encoder output is not cached: the
  plan either covers the whole range (and reserves the encoder cache for it) or stops before it
  (or schedules nothing, when the chunk starts inside such an item).
- An encoder run is planned only for an item the chunk reaches and whose output is not cached;
  cached items are only referenced. Items before ``start`` are never touched.
- Every change a plan makes to the encoder cache is listed in it, so :func:`rollback_plan`
  restores the cache exactly (cancelled allocations never reach the runner).
"""

from __future__ import annotations

import dataclasses

from mmis.engine.encoder_cache import EncoderCacheManager
from mmis.engine.request import Request


@dataclasses.dataclass
class EncoderPlan:
    num_new_tokens: int
    encoder_inputs: list[int] = dataclasses.field(default_factory=list)  # mm_features indexes
    allocated: list[str] = dataclasses.field(default_factory=list)  # new entries, this pass
    acquired: list[str] = dataclasses.field(default_factory=list)  # new references, this pass
    encoder_tokens: int = 0


def plan_encoder(
    cache: EncoderCacheManager, request: Request, start: int, num_new: int, encoder_budget: int
) -> EncoderPlan:
    """Trim tokens ``[start, start + num_new)`` of ``request`` and reserve its encoder runs."""
    plan = EncoderPlan(num_new)
    features = request.mm_features
    if not features:
        return plan
    end = start + num_new
    rid = request.request_id
    for idx in sorted(range(len(features)), key=lambda i: features[i].placeholder.offset):
        feature = features[idx]
        offset, length = feature.placeholder.offset, feature.placeholder.length
        if offset >= end:
            break
        if offset + length <= start:
            continue
        held = rid in cache.refs(feature.mm_hash)
        if cache.acquire(rid, feature.mm_hash):
            if not held:
                plan.acquired.append(feature.mm_hash)
            continue
        fits = (
            offset + length <= end
            and plan.encoder_tokens + length <= encoder_budget
            and cache.can_allocate(length)
        )
        if not fits:
            end = max(offset, start)  # stop before the item (or schedule nothing)
            break
        cache.allocate(rid, feature.mm_hash, length)
        plan.allocated.append(feature.mm_hash)
        plan.encoder_inputs.append(idx)
        plan.encoder_tokens += length
    plan.num_new_tokens = end - start
    return plan


def rollback_plan(cache: EncoderCacheManager, request: Request, plan: EncoderPlan) -> None:
    """Undo ``plan`` (its chunk will not be scheduled in this pass)."""
    for mm_hash in plan.allocated:
        cache.cancel(request.request_id, mm_hash)
    for mm_hash in plan.acquired:
        cache.release(request.request_id, mm_hash)
    plan.allocated.clear()
    plan.acquired.clear()
    plan.encoder_inputs.clear()
