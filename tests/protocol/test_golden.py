"""S9: the current encoding of every canonical sample equals its checked-in golden bytes,
and every checked-in version of every fixture decodes with the current decoders."""

from __future__ import annotations

import json

import msgspec

from mmis.protocol import WIRE_STRUCTS, MultiModalFeature, WireCodec, describe_all


def test_current_encoding_is_byte_exact(golden, sample) -> None:
    path = golden.fixture_path(sample.name)
    assert path.exists(), f"no golden fixture {path}; run tests/protocol/golden/regenerate.py"
    expected = golden.read_frames(path)
    actual = [bytes(frame) for frame in golden.encode_sample(WireCodec(), sample)]
    assert len(actual) == len(expected), f"{sample.name}: frame count changed"
    for index, (want, got) in enumerate(zip(expected, actual, strict=True)):
        assert got == want, f"{sample.name}: frame {index} differs from the golden bytes"


def test_golden_fixture_decodes_to_the_sample(golden, sample) -> None:
    frames = golden.read_frames(golden.fixture_path(sample.name))
    codec = WireCodec()
    if sample.kind == "request":
        request_type, decoded = codec.decode_request(frames)
        assert request_type.value == frames[0]
    elif sample.kind == "outputs":
        decoded = codec.decode_outputs(frames)
    else:
        decoded = codec.decode(frames, type(sample.message))
    assert type(decoded) is type(sample.message)
    golden.assert_same(sample.message, decoded)


def test_every_version_decodes_with_current_decoders(golden) -> None:
    by_name = {s.name: s for s in golden.samples()}
    codec = WireCodec()
    checked = 0
    for ver in golden.versions():
        for path in sorted((golden.GOLDEN_DIR / ver).glob(f"*{golden.SUFFIX}")):
            sample = by_name.get(path.stem)
            if sample is None:
                continue  # a sample retired since that version: nothing to decode it into
            frames = golden.body_and_tensors(sample, golden.read_frames(path))
            decoded = codec.decode(frames, type(sample.message))
            assert type(decoded) is type(sample.message), f"{ver}/{path.name}"
            checked += 1
    assert checked >= len(by_name), "some samples have no fixture in any version"


def test_every_wire_struct_has_a_standalone_golden(golden) -> None:
    covered = {type(s.message) for s in golden.samples()}
    missing = [s.__name__ for s in WIRE_STRUCTS if s not in covered]
    assert not missing, f"wire structs without a golden sample: {missing}"


def test_current_version_schema_is_the_current_schema(golden) -> None:
    """Regenerating is what records an appended field; a stale schema.json fails here."""
    path = golden.GOLDEN_DIR / golden.CURRENT_VERSION / "schema.json"
    assert json.loads(path.read_text()) == describe_all()


def test_v5_features_decode_with_their_second_hash_ignored(golden) -> None:
    """v6 retired ``MultiModalFeature``'s second hash: v5 bytes (which carried a different
    value there) decode to the same item, and v6 writes the slot empty."""
    sample = next(s for s in golden.samples() if s.name == "struct_MultiModalFeature")
    v5 = golden.GOLDEN_DIR / "v5" / f"{sample.name}{golden.SUFFIX}"
    frames = golden.body_and_tensors(sample, golden.read_frames(v5))
    decoded = WireCodec().decode(frames, MultiModalFeature)
    assert decoded._identifier == "user-uuid-7"  # what v5 sent; nothing reads it
    assert (decoded.modality, decoded.mm_hash, decoded.placeholder) == (
        sample.message.modality,
        sample.message.mm_hash,
        sample.message.placeholder,
    )
    body = msgspec.msgpack.decode(WireCodec().encode(sample.message)[0])
    assert body[:3] == ["image", "d4" * 32, ""]
