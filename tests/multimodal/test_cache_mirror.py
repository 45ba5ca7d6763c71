"""P0's shadow and P1's receiver, driven together: they mirror, and drift heals.

P0 here is the sender cache as a render uses it (lookup, send data only for misses, record
the request); P1 is the real receiver cache resolving the features P0 built.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from mmis.multimodal.cache import (
    TENSOR_OVERHEAD_BYTES,
    ReceiverCache,
    SenderCache,
    ShadowEntry,
    ShadowItem,
    item_nbytes,
)
from mmis.protocol.errors import MultiModalCacheMissError
from mmis.protocol.messages import MultiModalFeature, PlaceholderRange

BUDGET = 4000


def _tensors(h: str, size: int) -> dict[str, np.ndarray]:
    return {"pixel_values": np.full(size - TENSOR_OVERHEAD_BYTES, len(h), np.uint8)}


def _render(
    shadow: SenderCache, items: list[tuple[str, int]], *, bypass: bool = False
) -> tuple[list[MultiModalFeature], list[str]]:
    """One P0 render: returns the features to send and the shadow's evictions."""
    entries = shadow.lookup([h for h, _ in items])
    features: list[MultiModalFeature] = []
    recorded: list[ShadowItem] = []
    for (h, size), entry in zip(items, entries, strict=True):
        hit = entry is not None and not bypass
        data = None if hit else _tensors(h, size)
        features.append(
            MultiModalFeature(
                modality="image", mm_hash=h, placeholder=PlaceholderRange(0, 1), data=data
            )
        )
        nbytes = entry.nbytes if entry is not None else item_nbytes(_tensors(h, size))
        recorded.append(ShadowItem(h, ShadowEntry(nbytes=nbytes, placeholder_length=1)))
    return features, shadow.record_request(recorded)


def _workload(rng: random.Random, n: int) -> list[list[tuple[str, int]]]:
    sizes = {f"img{i}": rng.choice([300, 700, 1200, 2500, 4100]) for i in range(40)}
    requests = []
    for _ in range(n):
        picks = [f"img{rng.randrange(40)}" for _ in range(rng.randrange(1, 5))]
        requests.append([(h, sizes[h]) for h in picks])  # duplicates included on purpose
    return requests


def test_shadow_and_receiver_mirror_exactly_without_drift() -> None:
    rng = random.Random(3)
    shadow, receiver = SenderCache(BUDGET), ReceiverCache(BUDGET)
    hits = 0
    for items in _workload(rng, 600):
        features, shadow_evicted = _render(shadow, items)
        hits += sum(f.data is None for f in features)
        receiver.resolve(features)  # raises on any disagreement
        assert receiver.keys() == shadow.keys()
        gone = [h for h in dict.fromkeys(shadow_evicted) if not shadow.is_cached(h)]
        assert receiver.drain_evicted() == gone
    assert hits > 100  # the workload does exercise shadow hits
    assert receiver.oversize > 0 and shadow.oversize == receiver.oversize
    assert receiver.misses == 0


@pytest.mark.parametrize("variant", ["smaller_p1_budget", "p1_restart", "fault_knob"])
def test_drift_is_detected_batched_and_healed_by_one_retry(variant: str) -> None:
    rng = random.Random(5)
    shadow = SenderCache(BUDGET)
    receiver = ReceiverCache(BUDGET // 2 if variant == "smaller_p1_budget" else BUDGET)
    fault = random.Random(9)
    misses = retries = 0
    for step, items in enumerate(_workload(rng, 400)):
        if variant == "p1_restart" and step == 200:
            receiver = ReceiverCache(BUDGET)
        if variant == "fault_knob":
            receiver.evict_random(0.2, fault)
        features, _ = _render(shadow, items)
        try:
            resolved = receiver.resolve(features)
        except MultiModalCacheMissError as miss:
            misses += 1
            sent_none = {f.mm_hash for f in features if f.data is None}
            assert set(miss.mm_hashes) <= sent_none and miss.mm_hashes
            for h in miss.mm_hashes:  # P0 invalidates, then the endpoint retries once
                shadow.invalidate(h)
            features, _ = _render(shadow, items, bypass=True)
            resolved = receiver.resolve(features)
            retries += 1
        for (h, size), tensors in zip(items, resolved, strict=True):
            assert tensors["pixel_values"].nbytes == size - TENSOR_OVERHEAD_BYTES
            assert int(tensors["pixel_values"][0]) == len(h)
    assert misses > 0 and retries == misses
