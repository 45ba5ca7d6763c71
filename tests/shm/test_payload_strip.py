"""S7 at unit level: a prefix-cache hit strips payloads but never SHM descriptors."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from mmis.multimodal.cache import ReceiverCache
from mmis.multimodal.payload_strip import (
    PayloadStripError,
    is_covered,
    strip_covered_payloads,
)
from mmis.protocol.messages import MultiModalFeature, PlaceholderRange, ShmAddress
from mmis.shm import ShmReaderSet, ShmWriter

PROMPT = list(range(40))  # image placeholder at tokens 5..20


def feature(data, offset: int = 5, length: int = 16, mm_hash: str = "img") -> MultiModalFeature:
    return MultiModalFeature("image", mm_hash, mm_hash, PlaceholderRange(offset, length), data)


def test_covered_inline_payload_is_dropped_but_partial_is_kept(image_payload) -> None:
    covered = feature(image_payload(1), offset=0, length=8)
    partial = feature(image_payload(2), offset=8, length=16)
    out = strip_covered_payloads([covered, partial], num_computed_tokens=20)
    assert out[0].data is None
    assert out[1] is partial
    assert covered.data is not None  # the input (the scheduler's copy) is untouched


def test_boundaries_of_coverage() -> None:
    item = feature({"x": np.zeros(1)}, offset=5, length=16)  # tokens 5..20
    assert not is_covered(item, 20)
    assert is_covered(item, 21)
    assert strip_covered_payloads([item], 20)[0] is item
    assert strip_covered_payloads([item], 21)[0].data is None
    assert strip_covered_payloads([item], 0)[0] is item


def test_keep_names_survive_stripping(image_payload) -> None:
    out = strip_covered_payloads([feature(image_payload(1))], 40, keep={"image_grid_thw"})
    assert list(out[0].data) == ["image_grid_thw"]


def test_covered_shm_descriptor_is_kept(make_writer, image_payload) -> None:
    address = make_writer().put(image_payload(1))
    item = feature(address)
    assert strip_covered_payloads([item], num_computed_tokens=40)[0].data is address


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_bad_token_counts_are_typed_errors(bad) -> None:
    with pytest.raises(PayloadStripError):
        strip_covered_payloads([feature(None)], bad)


def test_bad_placeholder_is_a_typed_error() -> None:
    with pytest.raises(PayloadStripError, match="invalid placeholder"):
        strip_covered_payloads([feature({"x": np.zeros(1)}, offset=-1)], 10)


def _naive_strip(features: Sequence[MultiModalFeature], n: int) -> list[MultiModalFeature]:
    """The bug S7 guards against: strip every covered item, descriptors included."""
    out = []
    for f in features:
        end = f.placeholder.offset + f.placeholder.length
        out.append(
            MultiModalFeature(f.modality, f.mm_hash, f.identifier, f.placeholder, None)
            if end <= n
            else f
        )
    return out


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
    second = _send_twice(writer, shm_dir, image_payload(7), strip_covered_payloads)
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
