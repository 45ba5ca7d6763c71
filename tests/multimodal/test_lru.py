"""The byte-budget LRU both caches share."""

from __future__ import annotations

import random

import pytest

from mmis.multimodal.cache import ByteBudgetLRU


def _lru(capacity: int = 10) -> ByteBudgetLRU[str, int]:
    return ByteBudgetLRU(capacity)


def test_put_evicts_oldest_first_and_reports_in_order() -> None:
    lru = _lru(10)
    assert lru.put("a", 1, 4) == []
    assert lru.put("b", 2, 4) == []
    assert lru.put("c", 3, 2) == []
    assert lru.total_bytes == 10
    assert lru.put("d", 4, 7) == ["a", "b"]
    assert list(lru) == ["c", "d"]
    assert lru.total_bytes == 9


def test_peek_and_contains_do_not_touch() -> None:
    lru = _lru(8)
    lru.put("a", 1, 4)
    lru.put("b", 2, 4)
    assert lru.peek("a") == 1
    assert lru.contains("a") and "a" in lru
    assert lru.size_of("a") == 4
    assert lru.put("c", 3, 4) == ["a"]  # "a" stayed the oldest


def test_touch_and_get_refresh() -> None:
    lru = _lru(8)
    lru.put("a", 1, 4)
    lru.put("b", 2, 4)
    assert lru.touch("a") is True
    assert lru.touch("zz") is False
    assert lru.put("c", 3, 4) == ["b"]
    assert lru.get("a") == 1
    assert list(lru) == ["c", "a"]
    assert lru.get("missing") is None


def test_replace_updates_size_and_order() -> None:
    lru = _lru(10)
    lru.put("a", 1, 4)
    lru.put("b", 2, 4)
    assert lru.put("a", 9, 7) == ["b"]  # a's old 4 bytes are released first
    assert lru.peek("a") == 9 and lru.total_bytes == 7
    assert list(lru) == ["a"]


def test_oversize_is_never_stored_and_drops_stale_entry() -> None:
    lru = _lru(10)
    lru.put("a", 1, 4)
    assert lru.fits(10) and not lru.fits(11)
    assert lru.put("big", 2, 11) == []
    assert "big" not in lru and list(lru) == ["a"]
    assert lru.put("a", 3, 11) == ["a"]
    assert len(lru) == 0 and lru.total_bytes == 0


def test_zero_capacity_stores_only_empty_items() -> None:
    lru = _lru(0)
    assert lru.put("a", 1, 1) == []
    assert len(lru) == 0
    assert lru.put("z", 1, 0) == []
    assert "z" in lru


def test_pop_and_clear() -> None:
    lru = _lru(10)
    lru.put("a", 1, 3)
    lru.put("b", 2, 3)
    assert lru.pop("a") == 1 and lru.pop("a") is None
    assert lru.total_bytes == 3
    assert lru.clear() == ["b"]
    assert lru.total_bytes == 0 and len(lru) == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_capacity(bad: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        ByteBudgetLRU(bad)  # type: ignore[arg-type]


def test_bad_nbytes() -> None:
    with pytest.raises(ValueError, match="nbytes"):
        _lru().put("a", 1, -3)


def test_total_matches_model_under_random_operations() -> None:
    rng = random.Random(7)
    lru = _lru(50)
    model: dict[str, int] = {}  # key -> size, insertion order = recency
    for _ in range(3000):
        key = f"k{rng.randrange(20)}"
        op = rng.random()
        if op < 0.5:
            size = rng.randrange(0, 30)
            evicted = lru.put(key, 0, size)
            model.pop(key, None)
            expected: list[str] = []
            while sum(model.values()) + size > 50 and size <= 50:
                victim = next(iter(model))
                expected.append(victim)
                del model[victim]
            if size <= 50:
                model[key] = size
            assert [e for e in evicted if e != key] == expected
        elif op < 0.8:
            if lru.touch(key):
                model[key] = model.pop(key)
        else:
            lru.pop(key)
            model.pop(key, None)
        assert list(lru) == list(model)
        assert lru.total_bytes == sum(model.values()) <= 50
