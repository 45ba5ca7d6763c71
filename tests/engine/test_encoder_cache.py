"""Encoder cache manager: lazy LRU eviction, references, and the S8 freed-report invariant."""

from __future__ import annotations

import pytest

from mmis.engine.scheduling.encoder_cache import EncoderCacheError, EncoderCacheManager


class NaiveEncoderCache(EncoderCacheManager):
    """Reports every eviction of the pass, as the bug of scenario S8 did."""

    def take_freed(self) -> list[str]:
        out = list(self._freed)
        self._freed.clear()
        return out


def s8_literal(cache: EncoderCacheManager) -> list[str]:
    """Cache of 8; a and b (4 each) fill it and are freed; c (8) evicts both; c's admission is
    rolled back in the same pass (its encoder run is never scheduled) and a is allocated again.
    """
    cache.allocate("A", "a", 4)
    cache.allocate("B", "b", 4)
    cache.release_all("A")
    cache.release_all("B")
    assert cache.take_freed() == []  # end of the previous pass: nothing evicted yet
    assert cache.can_allocate(8)
    cache.allocate("C", "c", 8)
    assert "a" not in cache and "b" not in cache
    cache.cancel("C", "c")
    assert cache.can_allocate(4)
    cache.allocate("D", "a", 4)
    return cache.take_freed()


def s8_two_steps(cache: EncoderCacheManager) -> list[str]:
    """The same pattern where c (4) evicts a, and re-allocating a evicts b."""
    cache.allocate("A", "a", 4)
    cache.allocate("B", "b", 4)
    cache.release_all("A")
    cache.release_all("B")
    assert cache.take_freed() == []
    assert cache.can_allocate(4)
    cache.allocate("C", "c", 4)
    assert cache.can_allocate(4)
    cache.allocate("D", "a", 4)
    return cache.take_freed()


@pytest.mark.parametrize("scenario", [s8_literal, s8_two_steps])
def test_s8_reallocated_hash_is_not_reported_as_freed(scenario):
    assert scenario(EncoderCacheManager(8)) == ["b"]


@pytest.mark.parametrize("scenario", [s8_literal, s8_two_steps])
def test_s8_scenario_catches_the_naive_report(scenario):
    # the same scenario on the naive report gives ["a", "b"]: the exact-equality check above
    # is what tells the two apart
    assert scenario(NaiveEncoderCache(8)) == ["a", "b"]


def test_freed_report_is_once_per_pass_and_deduplicated():
    cache = EncoderCacheManager(4)
    cache.allocate("A", "x", 4)
    cache.release_all("A")
    assert cache.can_allocate(4)
    cache.allocate("B", "y", 4)
    cache.release_all("B")
    assert cache.can_allocate(4)  # evicts y
    cache.allocate("C", "x", 4)
    cache.release_all("C")
    assert cache.can_allocate(4)  # evicts x again
    assert cache.take_freed() == ["x", "y"]
    assert cache.take_freed() == []


def test_unreferenced_entries_are_kept_until_space_is_needed():
    cache = EncoderCacheManager(12)
    for rid, h in (("A", "a"), ("B", "b"), ("C", "c")):
        cache.allocate(rid, h, 4)
    cache.release_all("B")
    cache.release_all("A")
    assert "a" in cache and "b" in cache  # kept for reuse
    assert cache.num_free_slots == 0 and cache.num_freeable_slots == 8
    assert cache.acquire("D", "b")  # reuse: b is referenced again, no longer freeable
    assert cache.can_allocate(4)  # must evict a (the only freeable entry)
    assert "a" not in cache and "b" in cache
    assert cache.take_freed() == ["a"]


def test_eviction_is_least_recently_freed_first():
    cache = EncoderCacheManager(12)
    for rid, h in (("A", "a"), ("B", "b"), ("C", "c")):
        cache.allocate(rid, h, 4)
    for rid in ("C", "A", "B"):
        cache.release_all(rid)
    assert cache.can_allocate(8)
    assert cache.take_freed() == ["c", "a"]
    assert "b" in cache


def test_cannot_allocate_evicts_nothing():
    cache = EncoderCacheManager(8)
    cache.allocate("A", "a", 4)
    cache.allocate("B", "b", 4)
    cache.release_all("A")
    assert not cache.can_allocate(8)  # b is still referenced: 4 slots at most
    assert "a" in cache
    assert cache.take_freed() == []


def test_cancel_of_a_fresh_allocation_is_not_reported():
    cache = EncoderCacheManager(8)
    assert cache.can_allocate(4)
    cache.allocate("A", "a", 4)
    cache.cancel("A", "a")
    assert "a" not in cache and cache.num_free_slots == 8
    assert cache.take_freed() == []


def test_cancel_refuses_an_entry_others_rely_on():
    cache = EncoderCacheManager(8)
    cache.allocate("A", "a", 4)
    assert cache.acquire("B", "a")
    with pytest.raises(EncoderCacheError, match="other requests"):
        cache.cancel("A", "a")


def test_allocate_without_room_is_a_typed_error():
    cache = EncoderCacheManager(4)
    cache.allocate("A", "a", 4)
    with pytest.raises(EncoderCacheError, match="can_allocate"):
        cache.allocate("B", "b", 1)
    with pytest.raises(EncoderCacheError, match="already cached"):
        cache.allocate("B", "a", 4)


def test_slot_accounting_stays_balanced():
    cache = EncoderCacheManager(10)
    cache.allocate("A", "a", 3)
    cache.allocate("A", "b", 5)
    assert cache.acquire("B", "a")
    cache.release_all("A")
    assert cache.refs("a") == {"B"} and cache.refs("b") == frozenset()
    assert cache.num_free_slots == 2 and cache.num_freeable_slots == 7
    cache.release_all("B")
    assert cache.can_allocate(10)
    assert cache.num_free_slots == 10 and cache.usage() == 0.0
