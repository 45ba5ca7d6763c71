"""Items other P0s stored, queued by the output handler and learned by the next render's drain.

The order of one batch is reset, evictions, stores; across batches the last report about a
hash wins, and an idle P0 (no render, no drain) keeps at most ``MAX_PENDING_STORES``.
"""

from __future__ import annotations

from mmis.frontend.client import pending_invalidations
from mmis.frontend.client.pending_invalidations import PendingInvalidations
from mmis.multimodal.cache import SenderCache, ShadowEntry, ShadowItem
from mmis.protocol.messages import CachedItem


def item(h: str, nbytes: int = 10, length: int = 3) -> CachedItem:
    return CachedItem(h, nbytes, length)


def setup() -> tuple[SenderCache, PendingInvalidations]:
    shadow = SenderCache(1000)
    return shadow, PendingInvalidations(shadow)


def test_learned_items_reach_the_shadow_at_the_next_drain_with_their_lengths() -> None:
    shadow, pending = setup()
    assert pending.learn([item("a", 10, 5), item("b", 20, 7)]) == 2
    assert shadow.keys() == []  # nothing changes off the render worker
    assert pending.drain() == 2
    assert shadow.keys() == ["a", "b"]
    assert shadow.get("b") == ShadowEntry(20, 7)
    assert shadow.learned == 2 and pending.learned() == []


def test_an_item_the_shadow_holds_keeps_its_own_place() -> None:
    shadow, pending = setup()
    shadow.record_request(
        [ShadowItem("a", ShadowEntry(10, 3)), ShadowItem("b", ShadowEntry(10, 3))]
    )
    assert pending.learn([item("a")]) == 0
    pending.drain()
    assert shadow.keys() == ["a", "b"]


def test_an_eviction_after_a_store_wins() -> None:
    shadow, pending = setup()
    pending.learn([item("x")])
    pending.enqueue(["x"])  # evicted before the shadow applied the store
    pending.drain()
    assert not shadow.is_cached("x")


def test_a_store_after_a_pending_eviction_wins() -> None:
    shadow, pending = setup()
    shadow.record_request([ShadowItem("x", ShadowEntry(10, 3))])
    pending.enqueue(["x"])  # evicted ...
    assert pending.learn([item("x")]) == 1  # ... then stored again by another P0
    pending.drain()
    assert shadow.keys() == ["x"]


def test_a_reset_drops_what_was_queued_before_it_not_after() -> None:
    shadow, pending = setup()
    shadow.record_request([ShadowItem("old", ShadowEntry(10, 3))])
    pending.learn([item("before")])
    pending.request_clear()  # P1's shadow_reset (or a new epoch)
    pending.learn([item("after")])
    pending.drain()
    assert shadow.keys() == ["after"]


def test_an_idle_p0_keeps_a_bounded_queue(monkeypatch) -> None:
    monkeypatch.setattr(pending_invalidations, "MAX_PENDING_STORES", 5)
    shadow, pending = setup()
    for i in range(40):  # heartbeats keep bringing news; no render drains them
        pending.learn([item(f"h{i}")])
        assert len(pending.learned()) <= 5
    assert pending.learned_dropped == 35
    pending.drain()
    assert shadow.keys() == [f"h{i}" for i in range(35, 40)]  # the newest are kept
