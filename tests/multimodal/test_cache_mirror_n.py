"""N shadows on one receiver: the invariant of ``multimodal/cache.py`` for several P0s.

The real pieces without processes or sockets: P1 is a :class:`ReceiverCache` and the
:class:`OutputChannel` that keeps each client's unheard news; each P0 is a
:class:`SenderCache` with its :class:`PendingInvalidations`, fed what its batches carry in
their order (reset, evictions, stores) the way the engine client hands them on. A request
follows the drift chain: render (drain first), resolve, and on a miss one retry with data.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from mmis.engine.output_channel import OutputChannel
from mmis.frontend.client.pending_invalidations import PendingInvalidations
from mmis.multimodal.cache import (
    TENSOR_OVERHEAD_BYTES,
    ReceiverCache,
    SenderCache,
    ShadowEntry,
    ShadowItem,
    item_nbytes,
)
from mmis.protocol.errors import MultiModalCacheMissError
from mmis.protocol.messages import EngineCoreOutputs, MultiModalFeature, PlaceholderRange

BUDGET = 6000


def _tensors(h: str) -> dict[str, np.ndarray]:
    size = 300 + 97 * (sum(map(ord, h)) % 23)  # fixed per hash, 300..2434 bytes
    return {"pixel_values": np.full(size - TENSOR_OVERHEAD_BYTES, len(h), np.uint8)}


def _length(h: str) -> int:
    return 1 + sum(map(ord, h)) % 7  # the placeholder length is fixed by the hash


class P1:
    def __init__(self, budget: int = BUDGET) -> None:
        self.receiver = ReceiverCache(budget)
        self.channel = OutputChannel(cache_epoch=self.receiver.epoch)
        self.fault_rate = 0.0
        self.rng = random.Random(7)

    def handle(self, origin: int, features: list[MultiModalFeature]) -> list[str]:
        """P1's input thread on one request: the missing hashes (empty: admitted)."""
        if self.fault_rate:
            cached = [f.mm_hash for f in features if f.mm_hash in self.receiver]
            self.receiver.evict([h for h in cached if self.rng.random() < self.fault_rate])
        try:
            self.receiver.resolve(features)
            missing: list[str] = []
        except MultiModalCacheMissError as miss:
            missing = miss.mm_hashes
        self.channel.publish(self.receiver.drain_stored(), self.receiver.drain_evicted(), origin)
        return missing

    def sync(self, client: int) -> None:
        self.channel.resync(client, self.receiver.snapshot(4096))


class P0:
    def __init__(self, index: int, p1: P1, budget: int = BUDGET) -> None:
        self.index = index
        self.shadow = SenderCache(budget)
        self.pending = PendingInvalidations(self.shadow)
        self.items_sent = 0
        self.misses = 0
        self.connect(p1)

    def connect(self, p1: P1) -> None:
        self.p1 = p1
        p1.channel.register(self.index)
        self.pending.observe_epoch(p1.receiver.epoch)
        self.hear()

    def hear(self) -> None:
        """One batch arrives (an output, or a heartbeat's answer): the engine client's order."""
        batch = EngineCoreOutputs(cache_epoch=self.p1.channel.cache_epoch)
        self.p1.channel.attach_backlog(self.index, batch)
        self.pending.observe_epoch(batch.cache_epoch)
        if batch.shadow_reset:
            self.pending.request_clear()
        self.pending.enqueue(batch.evicted_mm_hashes)
        self.pending.learn(batch.stored_mm_items)

    def render(self, hashes: list[str], bypass: bool = False) -> list[MultiModalFeature]:
        self.pending.drain()
        entries = self.shadow.lookup(hashes)
        features, recorded = [], []
        for h, entry in zip(hashes, entries, strict=True):
            hit = entry is not None and not bypass
            if entry is not None:
                assert (entry.nbytes, entry.placeholder_length) == (
                    item_nbytes(_tensors(h)),
                    _length(h),
                ), "a learned entry must be what the storing P0 recorded"
            features.append(
                MultiModalFeature(
                    modality="image",
                    mm_hash=h,
                    placeholder=PlaceholderRange(0, _length(h)),
                    data=None if hit else _tensors(h),
                )
            )
            recorded.append(ShadowItem(h, ShadowEntry(item_nbytes(_tensors(h)), _length(h))))
        self.shadow.record_request(recorded)
        self.items_sent += len(hashes)
        return features

    def request(self, hashes: list[str]) -> None:
        """The drift chain: one miss -> batched invalidation -> one retry with data."""
        missing = self.p1.handle(self.index, self.render(hashes))
        self.hear()  # the request's output batch
        if missing:
            self.misses += 1
            self.pending.enqueue(missing)
            assert self.p1.handle(self.index, self.render(hashes, bypass=True)) == []
            self.hear()


def _quiesce(p0s: list[P0]) -> None:
    for p0 in p0s:
        p0.hear()
        p0.pending.drain()


def _assert_coherent(p0s: list[P0], receiver: ReceiverCache) -> None:
    """Once every batch was heard and applied, no shadow believes what P1 does not hold."""
    held = set(receiver.keys())
    for p0 in p0s:
        wrong = set(p0.shadow.keys()) - held
        assert not wrong, f"P0 {p0.index} believes P1 holds {sorted(wrong)}"


def _workload(seed: int, n: int, images: int = 30) -> list[list[str]]:
    rng = random.Random(seed)
    return [[f"img{rng.randrange(images)}" for _ in range(rng.randrange(1, 4))] for _ in range(n)]


def test_one_p0_still_mirrors_exactly_through_the_channel() -> None:
    p1 = P1()
    (p0,) = [P0(0, p1)]
    for hashes in _workload(1, 300):
        p0.request(hashes)
        p0.pending.drain()
        assert p0.shadow.keys() == p1.receiver.keys()  # same keys, same LRU order
    assert p0.misses == 0 and p0.shadow.learned == 0


@pytest.mark.parametrize("lag", [1, 3, 10], ids=["every-request", "every-3", "every-10"])
def test_n_shadows_never_miss_when_heard_and_always_heal(lag: int) -> None:
    """Other P0s hear P1 every ``lag`` requests (their heartbeat); a miss is always healed by
    the one retry and, once everything was heard, no shadow believes a dropped item."""
    p1 = P1()
    p0s = [P0(i, p1) for i in range(3)]
    rng = random.Random(lag)
    for step, hashes in enumerate(_workload(2, 600)):
        rng.choice(p0s).request(hashes)
        if step % lag == 0:
            for p0 in p0s:
                p0.hear()
    _quiesce(p0s)
    _assert_coherent(p0s, p1.receiver)
    if lag == 1:
        assert sum(p0.misses for p0 in p0s) == 0  # prevented: every eviction was heard
    assert sum(p0.shadow.learned for p0 in p0s) > 0


def test_an_item_stored_through_one_p0_is_a_hit_in_every_other() -> None:
    p1 = P1()
    p0s = [P0(i, p1) for i in range(4)]
    p0s[0].request(["photo"])
    stored = p1.receiver.stored
    for p0 in p0s[1:]:
        p0.hear()  # the heartbeat's answer
        features = p0.render(["photo"])
        assert features[0].data is None, f"P0 {p0.index} resent the data"
        assert p1.handle(p0.index, features) == []
    assert p1.receiver.stored == stored  # it crossed to P1 once for the whole pod


def _hit_rate(n: int) -> float:
    p1 = P1(budget=1 << 20)
    p0s = [P0(i, p1, budget=1 << 20) for i in range(n)]
    for round_ in range(4):  # 8 images, 4 times each, each time through the next P0
        for i in range(8):
            p0s[(round_ + i) % n].request([f"img{i}"])
        for p0 in p0s:
            p0.hear()
    hits = sum(p0.shadow.hits for p0 in p0s)
    return hits / sum(p0.items_sent for p0 in p0s)


def test_shadow_hit_rate_with_two_p0s_matches_one() -> None:
    one, two = _hit_rate(1), _hit_rate(2)
    assert one == pytest.approx(24 / 32)
    assert two >= 0.9 * one, (one, two)


def test_a_restarted_p0_starts_empty_and_learns_what_p1_holds() -> None:
    p1 = P1()
    first, second = P0(0, p1), P0(1, p1)
    for h in ("a", "b", "c"):
        first.request([h])
    second.request(["d"])
    restarted = P0(1, p1)  # the same client index, a new process: an empty shadow
    assert restarted.shadow.keys() == []
    p1.sync(1)  # its mm_cache_sync after the handshake
    restarted.hear()
    restarted.pending.drain()
    assert sorted(restarted.shadow.keys()) == ["a", "b", "c", "d"]
    _assert_coherent([first, restarted], p1.receiver)
    stored = p1.receiver.stored
    restarted.request(["a", "d"])
    assert restarted.misses == 0 and p1.receiver.stored == stored


def test_a_p1_restart_under_n_p0s_empties_every_shadow() -> None:
    p1 = P1()
    p0s = [P0(i, p1) for i in range(3)]
    for k, hashes in enumerate(_workload(3, 60)):
        p0s[k % 3].request(hashes)
    fresh = P1()  # a new process: empty cache, new epoch
    for p0 in p0s:
        p0.connect(fresh)
        p0.pending.drain()
        assert p0.shadow.keys() == []
        p0.misses = 0
    for k, hashes in enumerate(_workload(3, 60)):
        p0s[k % 3].request(hashes)
        for p0 in p0s:
            p0.hear()
    assert sum(p0.misses for p0 in p0s) == 0  # coherent again under the new epoch


def test_the_fault_knob_with_n_p0s_is_healed_by_the_chain_alone() -> None:
    p1 = P1()
    p1.fault_rate = 0.5
    p0s = [P0(i, p1) for i in range(3)]
    for k, hashes in enumerate(_workload(4, 300, images=10)):
        p0s[k % 3].request(hashes)  # asserts the retry never misses
        for p0 in p0s:
            p0.hear()
    assert sum(p0.misses for p0 in p0s) > 0  # drift on purpose happened, and healed
