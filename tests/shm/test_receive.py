"""P1's one descriptor resolver (ShmReaderSet.receive, called by the receiver cache):
every descriptor acked, payloads copied out first, stale ones one retryable miss."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from mmis.multimodal.cache import ReceiverCache
from mmis.protocol.errors import MultiModalCacheMissError
from mmis.protocol.messages import MultiModalFeature, PlaceholderRange
from mmis.shm import ForgedHandleError, ShmReaderSet


def feature(mm_hash: str, data, offset: int = 0) -> MultiModalFeature:
    return MultiModalFeature(
        modality="image", mm_hash=mm_hash, placeholder=PlaceholderRange(offset, 4), data=data
    )


@pytest.fixture
def receiver(shm_dir: Path) -> Iterator[ReceiverCache]:
    readers = ShmReaderSet(shm_dir)
    try:
        yield ReceiverCache(1 << 30, shm_reader=readers.receive)
    finally:
        readers.close()


def test_descriptors_become_owned_arrays_and_are_acked(
    make_writer, image_payload, assert_same, receiver
):
    writer = make_writer()
    a, b = image_payload(1), image_payload(2)
    inline, held = image_payload(3), image_payload(4)
    receiver.resolve([feature("none", held)])
    features = [
        feature("a", writer.put(a)),
        feature("none", None),
        feature("inline", inline),
        feature("b", writer.put(b)),
    ]
    out = receiver.resolve(features)
    assert_same(out[0], a)
    assert out[1] is receiver.peek("none")  # data=None: from the cache, no descriptor
    assert out[2]["pixel_values"] is inline["pixel_values"]  # inline tensors are not copied
    assert_same(out[3], b)
    assert all(arr.flags.owndata for arr in out[0].values())
    writer.reclaim()
    assert writer.stats().used == 0  # the arrays stay valid: they were copied before the ack
    assert_same(out[0], a)


def test_items_already_held_are_acked_when_resent_as_descriptors(
    make_writer, image_payload, assert_same, receiver
):
    writer = make_writer()
    payload = image_payload(1)
    receiver.resolve([feature("held", payload)])
    out = receiver.resolve([feature("held", writer.put(payload))])
    assert_same(out[0], payload)
    writer.reclaim()
    assert writer.stats().used == 0


def test_stale_items_become_one_cache_miss_and_the_rest_are_acked(
    make_writer, image_payload, clock, receiver
):
    writer = make_writer(capacity=8192, expire_after_s=1.0, clock=clock)
    lost1 = writer.put({"x": np.zeros(2000, np.uint8)})
    lost2 = writer.put({"x": np.zeros(2000, np.uint8)})
    clock.now += 5
    kept = writer.put({"x": np.ones(6000, np.uint8)})  # force-expires both older handles
    assert writer.stats().expired_handles == 2
    features = [feature("l1", lost1), feature("k", kept), feature("l2", lost2)]
    with pytest.raises(MultiModalCacheMissError) as info:
        receiver.resolve(features)
    assert info.value.mm_hashes == ["l1", "l2"]
    assert info.value.retryable
    assert "k" in receiver  # the good item was ingested: the retry carries only l1, l2
    writer.reclaim()
    assert writer.stats().used == 0  # the good item was still acknowledged


def test_a_forged_descriptor_fails_the_request_after_acking_the_rest(
    make_writer, image_payload, receiver
):
    writer = make_writer()
    good = writer.put(image_payload(1))
    forged = msgspec.structs.replace(writer.put(image_payload(2)), signature=bytes(32))
    with pytest.raises(ForgedHandleError):
        receiver.resolve([feature("f", forged), feature("g", good)])
    assert writer.reclaim() > 0  # handle 1 was acknowledged and is reclaimed...
    assert writer.stats().live_handles == 1  # ...handle 2 (sent forged) was not
