"""S7 at unit level: a prefix-cache hit over an SHM item must not keep its descriptor from the
receiver, or the writer's reference count never balances.

P1 resolves every feature in the receiver cache on its input thread, before the scheduler looks
at the prefix cache (docs/ARCHITECTURE.md, step 6), so the descriptor always arrives as sent;
the scheduler then leaves covered items' tensors out of the runner's input
(tests/engine/test_scheduler_output.py). The counter-example strips the descriptor first.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mmis.multimodal.cache import ReceiverCache
from mmis.protocol.messages import MultiModalFeature, PlaceholderRange, ShmAddress
from mmis.shm import ShmReaderSet, ShmWriter

PROMPT = list(range(40))  # image placeholder at tokens 5..20


def feature(data, offset: int = 5, length: int = 16, mm_hash: str = "img") -> MultiModalFeature:
    return MultiModalFeature(
        modality="image", mm_hash=mm_hash, placeholder=PlaceholderRange(offset, length), data=data
    )


def _naive_strip(features: Sequence[MultiModalFeature], n: int) -> list[MultiModalFeature]:
    """The bug S7 guards against: strip every covered item, descriptors included."""
    out = []
    for f in features:
        end = f.placeholder.offset + f.placeholder.length
        out.append(
            MultiModalFeature(
                modality=f.modality, mm_hash=f.mm_hash, placeholder=f.placeholder, data=None
            )
            if end <= n
            else f
        )
    return out


def _as_sent(features: Sequence[MultiModalFeature], _n: int) -> list[MultiModalFeature]:
    """What P1's input thread hands the receiver cache: the features as P0 sent them."""
    return list(features)


def _send_twice(writer: ShmWriter, shm_dir: Path, payload, strip) -> list[MultiModalFeature]:
    """The same image and prompt sent twice, with prefix caching and the SHM cache on.

    Returns the second request's features as P1's receiver cache gets them after ``strip``.
    """
    readers = ShmReaderSet(shm_dir)
    receiver = ReceiverCache(1 << 30, shm_reader=readers.receive)
    try:
        # request 1: sender-cache miss -> the tensors go into the store; no prefix hit
        first = feature(writer.put(payload))
        received = receiver.resolve(strip([first], 0))
        np.testing.assert_array_equal(received[0]["pixel_values"], payload["pixel_values"])
        # request 2: sender-cache hit -> the same descriptor is issued again; the prefix
        # cache now covers the whole prompt, including the image's placeholder span
        second = feature(writer.share(first.data))
        stripped = strip([second], len(PROMPT))
        again = receiver.resolve(stripped)  # the held item resolves either way
        np.testing.assert_array_equal(again[0]["pixel_values"], payload["pixel_values"])
        return stripped
    finally:
        readers.close()


def test_s7_descriptor_reaches_receiver_and_space_is_reclaimed(make_writer, shm_dir, image_payload):
    writer = make_writer()
    second = _send_twice(writer, shm_dir, image_payload(7), _as_sent)
    assert isinstance(second[0].data, ShmAddress)  # the descriptor reached the receiver
    assert writer.stats().outstanding_descriptors == 0  # both descriptors acknowledged
    writer.reclaim()
    stats = writer.stats()
    assert (stats.used, stats.live_handles, stats.reclaimed_handles) == (0, 0, 1)


def test_s7_dropping_the_descriptor_leaks_the_space(make_writer, shm_dir, image_payload):
    writer = make_writer()
    second = _send_twice(writer, shm_dir, image_payload(7), _naive_strip)
    assert second[0].data is None
    assert writer.stats().outstanding_descriptors == 1  # the second was never acknowledged
    assert writer.reclaim() == 0
    stats = writer.stats()
    assert stats.used > 0 and stats.live_handles == 1  # reclaimed only by force-expiry
