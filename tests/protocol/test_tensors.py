"""Tensor Ext values: every wire dtype round-trips, large payloads move zero-copy in their
own frame, small ones inline, torch tensors (bfloat16 too) are accepted, and every
malformed header, dtype, length or frame index is a ProtocolError."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import numpy as np
import pytest
import torch

from mmis.protocol import INLINE_THRESHOLD, TENSOR_EXT_CODE, ProtocolError, WireCodec
from mmis.protocol.tensors import WIRE_DTYPES, TensorHeader, TensorPacker, TensorUnpacker


def _roundtrip(value: object, codec: WireCodec | None = None) -> tuple[list, object]:
    codec = codec or WireCodec()
    frames = codec.encode({"t": value})
    return frames, codec.decode(frames, dict)["t"]


@pytest.mark.parametrize("name", sorted(WIRE_DTYPES))
@pytest.mark.parametrize("count", [3, 200], ids=["inline", "frame"])
def test_every_wire_dtype_round_trips(name: str, count: int) -> None:
    arr = (np.arange(count * 2) % 7).astype(name).reshape(2, count)
    frames, out = _roundtrip(arr)
    assert isinstance(out, np.ndarray)
    assert out.dtype == arr.dtype and out.shape == arr.shape
    assert np.array_equal(out, arr)
    assert len(frames) == (1 if arr.nbytes < INLINE_THRESHOLD else 2)


def test_threshold_boundary() -> None:
    below = np.zeros(INLINE_THRESHOLD - 1, dtype=np.uint8)
    at = np.zeros(INLINE_THRESHOLD, dtype=np.uint8)
    assert len(WireCodec().encode(below)) == 1
    assert len(WireCodec().encode(at)) == 2


def test_encode_is_zero_copy_for_large_contiguous_arrays() -> None:
    arr = np.arange(4096, dtype=np.float32).reshape(64, 64)
    frames = WireCodec().encode(arr)
    assert isinstance(frames[1], memoryview)
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.uint8), arr)
    assert frames[1].nbytes == arr.nbytes


def test_decode_is_zero_copy_over_the_received_frame() -> None:
    arr = np.arange(4096, dtype=np.float32)
    frames = [bytes(f) for f in WireCodec().encode(arr)]
    received = [frames[0], bytearray(frames[1])]
    out = WireCodec().decode(received, np.ndarray | None)  # type: ignore[arg-type]
    received[1][0:4] = np.float32(-5.0).tobytes()
    assert out[0] == -5.0, "the decoded array must view the frame, not a copy of it"


def test_non_contiguous_and_big_endian_arrays_are_normalised() -> None:
    base = np.arange(600, dtype=np.float64).reshape(20, 30)
    strided = base[:, ::3]
    assert not strided.flags.c_contiguous
    _, out = _roundtrip(strided)
    assert np.array_equal(out, strided) and out.flags.c_contiguous
    big = np.arange(100, dtype=">i4")
    _, out = _roundtrip(big)
    assert out.dtype == np.dtype("<i4") and np.array_equal(out, big)


def test_empty_and_zero_dim_arrays() -> None:
    for arr in (np.zeros((0, 5), dtype=np.float32), np.array(3.5), np.zeros((2, 0, 3))):
        _, out = _roundtrip(arr)
        assert out.shape == arr.shape and out.dtype == arr.dtype and np.array_equal(out, arr)


def test_torch_tensors_encode_and_decode_as_numpy() -> None:
    t = torch.arange(300, dtype=torch.float32).reshape(3, 100)[:, ::2]  # non-contiguous
    _, out = _roundtrip(t)
    assert isinstance(out, np.ndarray)
    assert np.array_equal(out, t.numpy())
    with_grad = torch.ones(4, requires_grad=True)
    _, out = _roundtrip(with_grad)
    assert np.array_equal(out, np.ones(4, dtype=np.float32))


@pytest.mark.parametrize("size", [8, 1000], ids=["inline", "frame"])
def test_bfloat16_travels_raw_and_decodes_as_torch(size: int) -> None:
    t = (torch.arange(size, dtype=torch.float32) / 3).to(torch.bfloat16)
    frames, out = _roundtrip(t)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    assert torch.equal(out, t)
    if size * 2 >= INLINE_THRESHOLD:
        assert bytes(frames[1]) == t.view(torch.int16).numpy().tobytes()


@pytest.mark.parametrize(
    "value",
    [np.array(["a", "b"]), np.array([object()], dtype=object), np.zeros(2, dtype="i4,f4")],
    ids=["str", "object", "structured"],
)
def test_unsupported_dtypes_are_refused_on_encode(value: np.ndarray) -> None:
    with pytest.raises(ProtocolError, match="cannot encode an array of dtype"):
        WireCodec().encode(value)


def test_unsupported_objects_are_refused_on_encode() -> None:
    with pytest.raises(ProtocolError, match=r"cannot encode a builtins\.object"):
        WireCodec().encode({"x": object()})


def _ext(header: TensorHeader, code: int = TENSOR_EXT_CODE) -> bytes:
    return msgspec.msgpack.encode(msgspec.msgpack.Ext(code, msgspec.msgpack.encode(header)))


@pytest.mark.parametrize(
    ("header", "frames", "match"),
    [
        (TensorHeader("float32", (2,), b"\0" * 7), [], "needs 8 bytes, got 7"),
        (TensorHeader("float32", (3,), 0), [b"\0" * 8], "needs 12 bytes, got 8"),
        (TensorHeader("float32", (2,), 1), [b"\0" * 8], "refers to frame 1, but the message has 1"),
        (TensorHeader("float32", (2,), -1), [b"\0" * 8], "refers to frame -1"),
        (TensorHeader("object", (1,), b"\0" * 8), [], "unsupported dtype 'object'"),
        (TensorHeader("float32", (-1, 2), b""), [], "negative dimension"),
    ],
    ids=["inline-length", "frame-length", "frame-index", "negative-index", "dtype", "shape"],
)
def test_malformed_tensors_are_protocol_errors(header, frames, match) -> None:
    with pytest.raises(ProtocolError, match=match):
        WireCodec().decode([_ext(header), *frames], object)


def test_malformed_tensor_header_is_a_protocol_error() -> None:
    body = msgspec.msgpack.encode(msgspec.msgpack.Ext(TENSOR_EXT_CODE, b"\xc1garbage"))
    with pytest.raises(ProtocolError, match="malformed tensor header"):
        WireCodec().decode([body], object)


@pytest.mark.parametrize("code", [0, 2, 5, 127, -2, -128])  # -1 is msgpack's timestamp
def test_unknown_ext_codes_are_protocol_errors(code: int) -> None:
    body = _ext(TensorHeader("float32", (2,), b"\0" * 8), code=code)
    with pytest.raises(ProtocolError, match=f"unknown msgpack ext code {code}"):
        WireCodec().decode([body], object)


def test_packer_and_unpacker_reject_bad_construction() -> None:
    with pytest.raises(ValueError, match="inline_threshold"):
        TensorPacker(-1)
    frames: list = []
    ext = TensorPacker(0).pack(np.zeros(1, dtype=np.int8), frames)
    assert len(frames) == 1  # threshold 0: every payload gets a frame
    out = TensorUnpacker().unpack(ext.code, memoryview(ext.data), frames)
    assert np.array_equal(out, np.zeros(1, dtype=np.int8))


def test_numpy_only_traffic_never_imports_torch() -> None:
    code = (
        "import sys, numpy as np\n"
        "from mmis.protocol import WireCodec\n"
        "c = WireCodec()\n"
        "out = c.decode(c.encode({'a': np.arange(1000.0)}), dict)['a']\n"
        "assert out.sum() == 499500.0\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False", "encoding/decoding numpy arrays imported torch"
