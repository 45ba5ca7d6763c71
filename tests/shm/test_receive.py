"""The receiver-side step: every descriptor acked, data=None skipped, problems collected."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from mmis.protocol.errors import MultiModalCacheMissError
from mmis.protocol.messages import MultiModalFeature, PlaceholderRange
from mmis.shm import ForgedHandleError, ShmReader, receive_features


def feature(mm_hash: str, data, offset: int = 0) -> MultiModalFeature:
    return MultiModalFeature("image", mm_hash, mm_hash, PlaceholderRange(offset, 4), data)


def test_descriptors_become_owned_arrays_and_are_acked(make_writer, image_payload, assert_same):
    writer = make_writer()
    a, b = image_payload(1), image_payload(2)
    inline = image_payload(3)
    features = [
        feature("a", writer.put(a)),
        feature("none", None),
        feature("inline", inline),
        feature("b", writer.put(b)),
    ]
    with ShmReader(writer.segment, directory=writer.directory) as reader:
        out = receive_features(reader, features)
    assert_same(out[0].data, a)
    assert out[1].data is None
    assert out[2].data is inline
    assert_same(out[3].data, b)
    assert all(arr.flags.owndata for arr in out[0].data.values())
    writer.reclaim()
    assert writer.stats().used == 0  # the arrays stay valid: they were copied before the ack
    assert_same(out[0].data, a)


def test_items_already_held_are_acked_without_reading(make_writer, image_payload):
    writer = make_writer()
    features = [feature("held", writer.put(image_payload(1)))]
    with ShmReader(writer.segment, directory=writer.directory) as reader:
        out = receive_features(reader, features, held=lambda h: h == "held")
    assert out[0].data is None
    writer.reclaim()
    assert writer.stats().used == 0


def test_stale_items_become_one_cache_miss_and_the_rest_are_acked(
    make_writer, image_payload, clock
):
    writer = make_writer(capacity=8192, expire_after_s=1.0, clock=clock)
    lost1 = writer.put({"x": np.zeros(2000, np.uint8)})
    lost2 = writer.put({"x": np.zeros(2000, np.uint8)})
    clock.now += 5
    kept = writer.put({"x": np.ones(6000, np.uint8)})  # force-expires both older handles
    assert writer.stats().expired_handles == 2
    features = [feature("l1", lost1), feature("k", kept), feature("l2", lost2)]
    with (
        ShmReader(writer.segment, directory=writer.directory) as reader,
        pytest.raises(MultiModalCacheMissError) as info,
    ):
        receive_features(reader, features)
    assert info.value.mm_hashes == ["l1", "l2"]
    assert info.value.retryable
    writer.reclaim()
    assert writer.stats().used == 0  # the good item was still acknowledged


def test_a_forged_descriptor_fails_the_request_after_acking_the_rest(make_writer, image_payload):
    writer = make_writer()
    good = writer.put(image_payload(1))
    forged = msgspec.structs.replace(writer.put(image_payload(2)), signature=bytes(32))
    with ShmReader(writer.segment, directory=writer.directory) as reader:
        with pytest.raises(ForgedHandleError):
            receive_features(reader, [feature("f", forged), feature("g", good)])
        assert writer.reclaim() > 0  # handle 1 was acknowledged and is reclaimed...
        assert writer.stats().live_handles == 1  # ...handle 2 (sent forged) was not
