"""S9: old -> new and new -> old for every wire struct.

For each canonical sample, the test defines the *next version* of its struct: the same
fields plus one appended at the end with a default (carrying a tensor, so the new frame
layout differs too). Then:
- old -> new: the next-version decoder reads the current golden bytes, every current value
  intact and the appended field at its default;
- new -> old: the current decoder reads the next version's bytes, values intact, the
  appended field (and the tensor frame only it referenced) ignored.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from mmis.protocol import WireCodec

NEXT_DEFAULT = "next-default"


def next_version(struct: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """``struct`` with ``appended_in_next: Any = NEXT_DEFAULT`` added after its last field."""
    config = struct.__struct_config__
    fields: list[Any] = []
    for info in msgspec.structs.fields(struct):
        if info.default is not msgspec.NODEFAULT:
            fields.append((info.name, info.type, info.default))
        elif info.default_factory is not msgspec.NODEFAULT:
            fields.append(
                (info.name, info.type, msgspec.field(default_factory=info.default_factory))
            )
        else:
            fields.append((info.name, info.type))
    fields.append(("appended_in_next", Any, NEXT_DEFAULT))
    return msgspec.defstruct(
        f"{struct.__name__}Next",
        fields,
        array_like=True,
        kw_only=True,  # a retired slot (optional) may sit before required fields
        frozen=config.frozen,
        tag=config.tag,
        tag_field=config.tag_field,
    )


def test_next_version_really_appends_one_field(golden) -> None:
    for sample in golden.samples():
        struct = type(sample.message)
        old = struct.__struct_fields__
        assert next_version(struct).__struct_fields__ == (*old, "appended_in_next")


def test_old_to_new_next_decoder_reads_current_golden(golden, sample) -> None:
    struct = type(sample.message)
    frames = golden.body_and_tensors(sample, golden.read_frames(golden.fixture_path(sample.name)))
    decoded = WireCodec().decode(frames, next_version(struct))
    golden.assert_same(sample.message, decoded)
    assert decoded.appended_in_next == NEXT_DEFAULT


def test_new_to_old_current_decoder_reads_next_version(golden, sample) -> None:
    struct = type(sample.message)
    values = msgspec.structs.asdict(sample.message)
    appended = np.arange(300, dtype=np.float64)  # > threshold: an extra tensor frame
    newer = next_version(struct)(**values, appended_in_next=appended)
    codec = WireCodec()
    frames = codec.encode(newer)
    current_frames = codec.encode(sample.message)
    assert len(frames) == len(current_frames) + 1, "the appended tensor must add a frame"
    assert bytes(frames[0]) != bytes(current_frames[0])
    decoded = codec.decode(frames, struct)
    assert type(decoded) is struct
    golden.assert_same(sample.message, decoded)
    # and through the request/outputs entry points, with the real type byte in front
    if sample.kind == "request":
        type_byte = golden.read_frames(golden.fixture_path(sample.name))[0]
        request_type, via_entry = codec.decode_request([type_byte, *frames])
        assert request_type.value == type_byte
        golden.assert_same(sample.message, via_entry)
    elif sample.kind == "outputs":
        golden.assert_same(sample.message, codec.decode_outputs(frames))
