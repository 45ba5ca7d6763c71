"""P0's metadata-only shadow of the receiver cache."""

from __future__ import annotations

from mmis.multimodal.cache import SenderCache, ShadowEntry, ShadowItem


def _item(h: str, nbytes: int, tokens: int = 4) -> ShadowItem:
    return ShadowItem(h, ShadowEntry(nbytes=nbytes, placeholder_length=tokens))


def _cache_with(capacity: int, *items: ShadowItem) -> SenderCache:
    cache = SenderCache(capacity)
    for item in items:
        cache.record_request([item])
    return cache


def test_lookup_counts_and_does_not_reorder() -> None:
    cache = _cache_with(10, _item("a", 4, tokens=9), _item("b", 4))
    got = cache.lookup(["b", "x", "a"])
    assert got[2] == ShadowEntry(nbytes=4, placeholder_length=9)
    assert got[1] is None and got[0] is not None
    assert (cache.hits, cache.misses) == (2, 1)
    assert cache.keys() == ["a", "b"]


def test_is_cached_has_no_side_effects() -> None:
    cache = _cache_with(10, _item("a", 4), _item("b", 4))
    assert cache.is_cached("a") and not cache.is_cached("zz")
    assert cache.get("a") is not None
    assert (cache.hits, cache.misses) == (0, 0)
    assert cache.keys() == ["a", "b"]
    cache.record_request([_item("c", 4)])
    assert cache.keys() == ["b", "c"]  # "a" was still the oldest


def test_request_touches_cached_items_before_recording_new_ones() -> None:
    cache = _cache_with(10, _item("a", 4), _item("b", 4))
    # the request re-uses "a" (sent as data=None) and brings "c": "c" must evict "b",
    # never "a", which P1 has to keep for this very request
    evicted = cache.record_request([_item("c", 4), _item("a", 4)])
    assert evicted == ["b"]
    assert cache.keys() == ["a", "c"]
    assert cache.evictions == 1


def test_items_larger_than_budget_are_never_recorded() -> None:
    cache = _cache_with(10, _item("a", 4))
    evicted = cache.record_request([_item("huge", 11), _item("b", 4)])
    assert evicted == []
    assert not cache.is_cached("huge")
    assert cache.keys() == ["a", "b"]
    assert cache.oversize == 1 and cache.recorded == 2
    assert cache.lookup(["huge"]) == [None]  # served uncached, with data, every time


def test_item_exactly_the_budget_is_recorded() -> None:
    cache = _cache_with(10, _item("a", 4))
    assert cache.record_request([_item("full", 10)]) == ["a"]
    assert cache.keys() == ["full"]


def test_invalidate_and_clear() -> None:
    cache = _cache_with(20, _item("a", 4), _item("b", 4), _item("c", 4))
    assert cache.invalidate("b") is True
    assert cache.invalidate("b") is False
    assert cache.keys() == ["a", "c"]
    assert cache.invalidate_many(["a", "nope"]) == 1
    assert cache.invalidations == 2
    stats = cache.stats()
    assert (stats.entries, stats.total_bytes, stats.capacity_bytes) == (1, 4, 20)
    cache.clear()
    assert len(cache) == 0 and cache.stats().total_bytes == 0 and cache.clears == 1
    cache.record_request([_item("a", 4)])
    assert cache.keys() == ["a"]


def test_metadata_is_kept() -> None:
    cache = SenderCache(100)
    entry = ShadowEntry(nbytes=8, placeholder_length=16, metadata={"grid_thw": (1, 4, 4)})
    cache.record_request([ShadowItem("q", entry)])
    assert cache.get("q") == entry
