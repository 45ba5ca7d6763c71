"""Put/read round trips, zero-copy views, payload validation and segment files."""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest

from mmis.protocol.messages import MultiModalFeature, PlaceholderRange, ShmAddress
from mmis.shm import (
    ShmPayloadError,
    ShmPayloadTooLargeError,
    ShmReader,
    ShmSegmentError,
    ShmStoreFullError,
    ShmWriter,
)


def test_round_trip_of_many_dtypes_and_shapes(make_writer, assert_same) -> None:
    writer = make_writer()
    base = np.arange(60, dtype=np.float64).reshape(6, 10)
    payload = {
        "f32": np.linspace(0, 1, 1001, dtype=np.float32),
        "f16": np.ones((2, 3), dtype=np.float16),
        "i8": np.array([-1, 2, -3], dtype=np.int8),
        "u64": np.array([2**64 - 1], dtype=np.uint64),
        "bool": np.array([True, False, True]),
        "c64": np.array([1 + 2j], dtype=np.complex64),
        "scalar": np.array(7, dtype=np.int32),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "strided": base[::2, ::3],  # not contiguous: written contiguously
        "big_endian": np.arange(5, dtype=">i4"),
    }
    address = writer.put(payload)
    with ShmReader(address.segment, directory=writer.directory) as reader:
        assert_same(reader.read(address, copy=True), payload)


def test_views_are_zero_copy_and_read_only(make_writer, image_payload) -> None:
    writer = make_writer()
    payload = image_payload(1)
    address = writer.put(payload)
    with ShmReader(address.segment, directory=writer.directory) as reader:
        views = reader.read(address)
        pixels = views["pixel_values"]
        assert isinstance(pixels.base, mmap.mmap)  # a view over the mapping, no copy
        assert not pixels.flags.writeable
        with pytest.raises(ValueError):
            pixels[0, 0, 0] = 1.0
        owned = reader.read(address, copy=True)["pixel_values"]
        assert owned.flags.owndata and owned.flags.writeable
        np.testing.assert_array_equal(owned, payload["pixel_values"])
        del views, pixels


def test_arrays_start_64_byte_aligned(make_writer) -> None:
    writer = make_writer()
    address = writer.put({"a": np.ones(3, np.int8), "b": np.ones(5, np.float64)})
    with ShmReader(address.segment, directory=writer.directory) as reader:
        views = reader.read(address)
        for arr in views.values():
            assert arr.__array_interface__["data"][0] % 64 == 0
        del views, arr


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        ({}, "non-empty mapping"),
        ({"a": np.array(["x"], dtype=object)}, "dtype object"),
        ({"a": np.array(["text"])}, "dtype <U4"),
        ({"a": np.zeros(2, dtype=[("x", "i4")])}, "only numeric"),
        ({1: np.zeros(2)}, "keys must be str"),
    ],
)
def test_bad_payloads_are_refused_with_a_typed_error(make_writer, payload, match) -> None:
    writer = make_writer()
    with pytest.raises(ShmPayloadError, match=match):
        writer.put(payload)
    assert writer.stats().used == 0


def test_payload_larger_than_the_store_is_refused(make_writer) -> None:
    writer = make_writer(capacity=4096)
    with pytest.raises(ShmPayloadTooLargeError, match="send it inline") as info:
        writer.put({"x": np.zeros(4096, dtype=np.uint8)})
    assert isinstance(info.value, ShmStoreFullError)  # one except clause covers both
    assert writer.stats().used == 0


def test_key_file_is_private_and_beside_the_segment(make_writer) -> None:
    writer = make_writer()
    assert writer.key_path.parent == writer.directory
    assert stat.S_IMODE(os.stat(writer.key_path).st_mode) == 0o600
    assert writer.key_path.read_bytes() == writer.key


def test_reader_refuses_a_key_file_others_can_read(make_writer) -> None:
    writer = make_writer()
    os.chmod(writer.key_path, 0o644)
    with pytest.raises(ShmSegmentError, match="must be 0600"):
        ShmReader(writer.segment, directory=writer.directory)


def test_explicit_key_replaces_the_key_file(make_writer, image_payload, assert_same) -> None:
    writer = make_writer()
    payload = image_payload(2)
    address = writer.put(payload)
    writer.key_path.unlink()
    with ShmReader(writer.segment, directory=writer.directory, key=writer.key) as reader:
        assert_same(reader.read(address, copy=True), payload)
    with pytest.raises(ShmSegmentError, match="does not exist"):
        ShmReader(writer.segment, directory=writer.directory)


def test_close_unlinks_segment_and_key(shm_dir: Path) -> None:
    writer = ShmWriter(1 << 16, directory=shm_dir, name="mmis-test-close")
    assert sorted(p.name for p in shm_dir.iterdir()) == ["mmis-test-close", "mmis-test-close.key"]
    writer.close()
    writer.close()  # idempotent
    assert list(shm_dir.iterdir()) == []
    with pytest.raises(ShmSegmentError, match="closed"):
        writer.put({"x": np.zeros(1)})


def test_descriptor_travels_inside_a_feature(make_writer, image_payload, assert_same) -> None:
    writer = make_writer()
    payload = image_payload(3)
    address = writer.put(payload)
    feature = MultiModalFeature(
        modality="image", mm_hash="h1", placeholder=PlaceholderRange(4, 16), data=address
    )
    wire = msgspec.msgpack.encode(feature)
    decoded = msgspec.msgpack.decode(wire, type=MultiModalFeature)
    assert isinstance(decoded.data, ShmAddress)
    assert decoded.data == address
    with ShmReader(address.segment, directory=writer.directory) as reader:
        assert_same(reader.read(decoded.data, copy=True), payload)


def test_default_directory_is_dev_shm_and_is_cleaned(image_payload: Callable) -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("this host has no /dev/shm; the other tests cover a tmp directory")
    with ShmWriter(1 << 16) as writer:
        assert (Path("/dev/shm") / writer.segment).exists()
        address = writer.put(image_payload(4))
        with ShmReader(address.segment) as reader:
            assert reader.ack(address)
        assert writer.reclaim() > 0
    assert not (Path("/dev/shm") / writer.segment).exists()
    assert not writer.key_path.exists()
