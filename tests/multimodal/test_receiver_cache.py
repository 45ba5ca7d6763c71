"""P1's receiver cache: resolve, batch all misses (S2), evictions, fault hooks."""

from __future__ import annotations

import random

import numpy as np
import pytest

from mmis.multimodal.cache import TENSOR_OVERHEAD_BYTES, ReceiverCache, item_nbytes
from mmis.protocol.errors import MultiModalCacheMissError, ProtocolError
from mmis.protocol.messages import MultiModalFeature, PlaceholderRange, ShmAddress

UNIT = 100  # payload bytes per unit of item size


def _tensors(seed: int, units: int = 1) -> dict[str, np.ndarray]:
    return {"pixel_values": np.full(UNIT * units - TENSOR_OVERHEAD_BYTES, seed, np.uint8)}


def _feat(h: str, data: object = None) -> MultiModalFeature:
    return MultiModalFeature(
        modality="image", mm_hash=h, placeholder=PlaceholderRange(0, 4), data=data
    )  # type: ignore[arg-type]


def _stored(cache: ReceiverCache, *hashes: str) -> None:
    cache.resolve([_feat(h, _tensors(i)) for i, h in enumerate(hashes)])


def test_item_size_unit_is_exact() -> None:
    assert item_nbytes(_tensors(0)) == UNIT


def test_s2_one_error_names_every_missing_hash_and_good_items_are_ingested() -> None:
    cache = ReceiverCache(10 * UNIT)
    _stored(cache, "h0", "h1", "h2", "h3")
    assert cache.evict(["h1", "h3"]) == ["h1", "h3"]  # drift P0 does not know about
    features = [
        _feat("h0"),
        _feat("h1"),
        _feat("h2"),
        _feat("h3"),
        _feat("h4", _tensors(44)),
        _feat("h5", _tensors(55)),
    ]
    with pytest.raises(MultiModalCacheMissError) as info:
        cache.resolve(features)
    assert info.value.mm_hashes == ["h1", "h3"]
    assert info.value.retryable is True
    wire = info.value.to_wire()
    assert (wire.code, wire.retryable) == ("multimodal_cache_miss", True)
    # the k - m good items are in: the ones sent with data are stored, the cached ones kept
    assert set(cache.keys()) == {"h0", "h2", "h4", "h5"}
    h4 = cache.peek("h4")
    assert h4 is not None and int(h4["pixel_values"][0]) == 44
    assert cache.misses == 2

    retry = [_feat(f"h{i}", _tensors(i)) for i in range(6)]
    resolved = cache.resolve(retry)
    assert [int(t["pixel_values"][0]) for t in resolved] == list(range(6))
    assert set(cache.keys()) == {f"h{i}" for i in range(6)}
    # and afterwards hash-only requests resolve from the cache
    again = cache.resolve([_feat(f"h{i}") for i in range(6)])
    assert [int(t["pixel_values"][0]) for t in again] == list(range(6))


def test_resolve_touches_every_key_before_storing() -> None:
    cache = ReceiverCache(3 * UNIT)
    _stored(cache, "old", "a", "b")
    # "old" is the LRU entry; this request reuses it and brings two new items, which must
    # evict "a" and "b", never the item the request itself relies on
    resolved = cache.resolve([_feat("n1", _tensors(7)), _feat("old"), _feat("n2", _tensors(8))])
    assert [int(t["pixel_values"][0]) for t in resolved] == [7, 0, 8]
    assert cache.keys() == ["old", "n1", "n2"]


def test_item_used_by_request_survives_its_own_eviction() -> None:
    cache = ReceiverCache(2 * UNIT)
    _stored(cache, "a")
    big = _tensors(9, units=2)
    resolved = cache.resolve([_feat("a"), _feat("big", big)])
    assert int(resolved[0]["pixel_values"][0]) == 0  # captured before "big" evicted it
    assert cache.keys() == ["big"]
    assert cache.drain_evicted() == ["a"]


def test_resent_payload_replaces_stale_entry() -> None:
    cache = ReceiverCache(10 * UNIT)
    cache.resolve([_feat("h", _tensors(1))])
    cache.resolve([_feat("h", _tensors(2))])
    assert int(cache.resolve([_feat("h")])[0]["pixel_values"][0]) == 2
    assert len(cache) == 1 and cache.stats().total_bytes == UNIT


def test_hash_only_sibling_resolved_by_data_in_same_request() -> None:
    cache = ReceiverCache(10 * UNIT)
    resolved = cache.resolve([_feat("d"), _feat("d", _tensors(3))])
    assert [int(t["pixel_values"][0]) for t in resolved] == [3, 3]


def test_oversize_item_is_used_but_never_stored() -> None:
    cache = ReceiverCache(2 * UNIT)
    _stored(cache, "a")
    resolved = cache.resolve([_feat("huge", _tensors(5, units=3))])
    assert int(resolved[0]["pixel_values"][0]) == 5
    assert "huge" not in cache and cache.keys() == ["a"]
    assert cache.oversize == 1
    with pytest.raises(MultiModalCacheMissError):
        cache.resolve([_feat("huge")])


def test_shm_address_is_read_through_the_injected_reader() -> None:
    reads: list[ShmAddress] = []

    def reader(address: ShmAddress) -> dict[str, np.ndarray]:
        reads.append(address)
        return _tensors(address.handle_id)

    cache = ReceiverCache(10 * UNIT, shm_reader=reader)
    address = ShmAddress("seg0", 0, UNIT, 17, 1, b"sig")
    resolved = cache.resolve([_feat("s", address)])
    assert reads == [address]
    assert int(resolved[0]["pixel_values"][0]) == 17
    assert "s" in cache
    cache.resolve([_feat("s", address)])  # a hit resent as a descriptor is read again
    assert len(reads) == 2


def test_shm_address_without_reader_is_a_protocol_error() -> None:
    cache = ReceiverCache(10 * UNIT)
    with pytest.raises(ProtocolError, match="shared-memory"):
        cache.resolve([_feat("s", ShmAddress("seg0", 0, 1, 1, 1, b""))])


def test_drain_evicted_reports_once_and_skips_resent_items() -> None:
    cache = ReceiverCache(2 * UNIT)
    _stored(cache, "a", "b", "c", "d")
    assert cache.drain_evicted() == ["a", "b"]
    assert cache.drain_evicted() == []
    _stored(cache, "e")  # evicts c
    _stored(cache, "c")  # c is back: evicting it again reports d, not c
    assert cache.drain_evicted() == ["d"]
    assert cache.evictions == 4


def test_fault_evictions_are_silent_unless_asked() -> None:
    cache = ReceiverCache(10 * UNIT)
    _stored(cache, "a", "b", "c")
    assert cache.evict(["a", "zz"]) == ["a"]
    assert cache.drain_evicted() == []
    assert cache.evict(["b"], silent=False) == ["b"]
    assert cache.drain_evicted() == ["b"]
    assert cache.fault_evictions == 2


def test_evict_random() -> None:
    cache = ReceiverCache(100 * UNIT)
    _stored(cache, *[f"h{i}" for i in range(50)])
    assert cache.evict_random(0.0, random.Random(1)) == []
    dropped = cache.evict_random(0.5, random.Random(1))
    assert 0 < len(dropped) < 50 and all(h not in cache for h in dropped)
    assert len(cache) == 50 - len(dropped)
    assert cache.evict_random(1.0, random.Random(1)) and len(cache) == 0
    with pytest.raises(ValueError, match="rate"):
        cache.evict_random(1.5, random.Random(1))


def test_clear_changes_epoch() -> None:
    cache = ReceiverCache(10 * UNIT)
    epoch = cache.epoch
    _stored(cache, "a")
    cache.clear()
    assert len(cache) == 0 and cache.epoch != epoch
    assert ReceiverCache(1).epoch != cache.epoch


def test_bad_payload_is_a_protocol_error() -> None:
    cache = ReceiverCache(10 * UNIT)
    with pytest.raises(ProtocolError, match="mapping"):
        cache.resolve([_feat("x", [1, 2, 3])])
