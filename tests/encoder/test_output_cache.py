"""The encoder's output cache (``engine/encoder/output_cache.py``): an LRU by bytes that
announces what it stores and evicts in the multimodal events format. No torch."""

from __future__ import annotations

import pytest

from mmis.engine.encoder.output_cache import OutputCache
from mmis.engine.mm_events import MMEventLog
from mmis.protocol.encoder import EncoderKey
from mmis.protocol.kv_events import MMItemEvicted, MMItemStored

KEY = EncoderKey("m", "", "float32")


def test_lru_by_bytes_evicts_the_oldest_and_announces_it() -> None:
    events = MMEventLog()
    cache = OutputCache(100, events)
    for name in ("a", "b", "c"):
        assert cache.put(KEY, name, name.upper(), 30)
    assert cache.bytes == 90
    assert cache.get(KEY, "a") == "A"  # a is now the most recently used: b is the oldest
    assert cache.put(KEY, "d", "D", 40)  # 130 > 100: b goes, and only b (c + a + d = 100)
    assert (KEY, "b") not in cache and cache.get(KEY, "b") is None
    assert [cache.get(KEY, n) for n in ("a", "c", "d")] == ["A", "C", "D"]
    assert cache.bytes == 100 and cache.evictions == 1
    assert events.drain() == [
        MMItemStored(mm_hash="a", nbytes=30),
        MMItemStored(mm_hash="b", nbytes=30),
        MMItemStored(mm_hash="c", nbytes=30),
        MMItemEvicted(mm_hash="b"),  # the eviction first, then the store that caused it
        MMItemStored(mm_hash="d", nbytes=40),
    ]
    assert cache.put(KEY, "e", "E", 70)  # evicts oldest first until it fits: a, c, then d
    assert events.drain() == [
        MMItemEvicted(mm_hash="a"),
        MMItemEvicted(mm_hash="c"),
        MMItemEvicted(mm_hash="d"),
        MMItemStored(mm_hash="e", nbytes=70),
    ]
    assert cache.bytes == 70 and len(cache) == 1


def test_an_item_beyond_the_budget_is_not_stored_and_evicts_nothing() -> None:
    events = MMEventLog()
    cache = OutputCache(50, events)
    assert cache.put(KEY, "a", "A", 50)
    events.drain()
    assert not cache.put(KEY, "huge", "H", 51)
    assert cache.get(KEY, "a") == "A" and events.drain() == []


def test_keys_are_apart_and_a_replacement_is_a_store_of_the_new_size() -> None:
    cache = OutputCache(100)
    other = EncoderKey("m", "", "bfloat16")
    cache.put(KEY, "a", "f32", 40)
    cache.put(other, "a", "bf16", 20)
    assert cache.get(KEY, "a") == "f32" and cache.get(other, "a") == "bf16"
    cache.put(KEY, "a", "f32 again", 10)
    assert cache.bytes == 30 and len(cache) == 2
    with pytest.raises(ValueError, match="nbytes"):
        cache.put(KEY, "b", "x", -1)
