"""Forged, tampered, stale and foreign descriptors are rejected with typed errors."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from mmis.protocol.errors import MMISError
from mmis.protocol.messages import ShmAddress
from mmis.shm import (
    ForgedHandleError,
    ShmReader,
    ShmReaderSet,
    StaleHandleError,
    UnknownSegmentError,
    signing,
)


@pytest.fixture
def stored(make_writer, image_payload):
    writer = make_writer()
    address = writer.put(image_payload(1))
    reader = ShmReader(writer.segment, directory=writer.directory)
    yield writer, reader, address
    reader.close()


def test_genuine_descriptor_is_accepted(stored) -> None:
    _, reader, address = stored
    reader.validate(address)
    assert reader.read(address, copy=True)["pixel_values"].shape == (3, 32, 32)


def test_forged_signature_is_rejected(stored) -> None:
    _, reader, address = stored
    forged = msgspec.structs.replace(address, signature=bytes(32))
    for call in (reader.read, reader.ack, reader.validate):
        with pytest.raises(ForgedHandleError, match="invalid signature"):
            call(forged)
    with pytest.raises(ForgedHandleError):
        reader.read(msgspec.structs.replace(address, signature=b"short"))


@pytest.mark.parametrize(
    "field, delta",
    [("offset", 64), ("offset", -64), ("length", 1), ("length", 4096), ("handle_id", 1)],
)
def test_tampered_fields_are_rejected(stored, field, delta) -> None:
    _, reader, address = stored
    tampered = msgspec.structs.replace(address, **{field: getattr(address, field) + delta})
    with pytest.raises(ForgedHandleError):
        reader.read(tampered)
    assert reader.ack(address)  # the genuine one still works


def test_out_of_range_fields_are_forged_not_a_crash(stored) -> None:
    _, reader, address = stored
    for bad in (-1, 2**64):
        with pytest.raises(ForgedHandleError, match="out of range"):
            reader.read(msgspec.structs.replace(address, offset=bad))


def test_stale_generation_is_rejected_even_when_signed(make_writer, image_payload) -> None:
    writer = make_writer(max_handles=1)  # every handle lands in slot 0: the slot is reused
    address = writer.put(image_payload(1))
    with ShmReader(writer.segment, directory=writer.directory) as reader:
        assert reader.ack(address)
        writer.reclaim()  # bumps slot 0's generation
        reused = writer.put(image_payload(2))
        assert reused.generation == address.generation + 1
        with pytest.raises(StaleHandleError, match="reclaimed or expired"):
            reader.read(address)
        # the live handle with the previous generation, correctly signed: only the
        # generation check can reject it
        fields = (reused.offset, reused.length, reused.handle_id, address.generation)
        older = msgspec.structs.replace(
            reused,
            generation=address.generation,
            signature=signing.sign(writer.key, reused.segment, *fields),
        )
        with pytest.raises(StaleHandleError, match="generation 0"):
            reader.read(older)
        assert reader.ack(older) is False
        assert reader.read(reused, copy=True)["pixel_values"].shape == (3, 32, 32)


def test_descriptor_for_another_segment_is_unknown(stored, make_writer) -> None:
    _, reader, _ = stored
    other = make_writer().put({"x": np.ones(4)})
    with pytest.raises(UnknownSegmentError, match="this reader serves"):
        reader.read(other)
    with pytest.raises(UnknownSegmentError):
        reader.ack(other)


def test_reader_set_attaches_by_name_and_rejects_unknown(stored, make_writer) -> None:
    writer, _, address = stored
    second = make_writer()
    other = second.put({"x": np.arange(3)})
    readers = ShmReaderSet(writer.directory)
    try:
        assert readers.read(address, copy=True)["pixel_values"].shape == (3, 32, 32)
        assert list(readers.read(other, copy=True)["x"]) == [0, 1, 2]
        missing = msgspec.structs.replace(address, segment="mmis-no-such-segment")
        with pytest.raises(UnknownSegmentError, match="does not exist"):
            readers.read(missing)
        for evil in ("../etc/passwd", ".hidden", "", "a/b"):
            with pytest.raises(UnknownSegmentError, match="invalid segment name"):
                readers.read(msgspec.structs.replace(address, segment=evil))
        first_reader = readers.reader(address)
        readers.forget(address.segment)
        assert readers.reader(address) is not first_reader  # re-attached on demand
        assert readers.ack(address)
    finally:
        readers.close()


def test_handle_errors_are_mmis_errors_with_wire_form(stored) -> None:
    _, reader, address = stored
    with pytest.raises(MMISError) as info:
        reader.read(msgspec.structs.replace(address, signature=bytes(32)))
    wire = info.value.to_wire()
    assert wire.code == "invalid_request" and not wire.retryable
    assert StaleHandleError.retryable


def test_writer_refuses_to_share_a_foreign_or_forged_descriptor(stored) -> None:
    writer, _, address = stored
    with pytest.raises(ForgedHandleError):
        writer.share(msgspec.structs.replace(address, signature=bytes(32)))
    with pytest.raises(UnknownSegmentError):
        writer.share(msgspec.structs.replace(address, segment="mmis-other"))
    assert isinstance(writer.share(address), ShmAddress)
