"""The multipart codec: requests P0 -> P1 and outputs P1 -> P0 round-trip over a real ZMQ
socket pair, and every malformed frame set -- pickles included -- is a ProtocolError."""

from __future__ import annotations

import pickle
import threading

import msgspec
import numpy as np
import pytest
import zmq

from mmis.protocol import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    ProtocolError,
    RequestType,
    UtilityCall,
    WireCodec,
    decode_outputs,
    decode_request,
    encode_outputs,
    encode_request,
)


@pytest.fixture
def zmq_pair():
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    pull.bind("inproc://codec-test")
    push.connect("inproc://codec-test")
    yield push, pull
    push.close(linger=0)
    pull.close(linger=0)
    ctx.term()


def test_samples_survive_a_real_zmq_round_trip(golden, sample, zmq_pair) -> None:
    push, pull = zmq_pair
    frames = golden.encode_sample(WireCodec(), sample)
    push.send_multipart(frames, copy=False)
    received = pull.recv_multipart(copy=False)  # zmq.Frame objects, decoded in place
    assert all(isinstance(f, zmq.Frame) for f in received)
    if sample.kind == "request":
        request_type, decoded = decode_request(received)
        assert request_type.value == bytes(frames[0])
    elif sample.kind == "outputs":
        decoded = decode_outputs(received)
    else:
        decoded = WireCodec().decode(received, type(sample.message))
    golden.assert_same(sample.message, decoded)


@pytest.mark.parametrize(
    ("msg", "request_type"),
    [
        (EngineCoreRequest("r", [1]), RequestType.ADD),
        (AbortRequests(["r"]), RequestType.ABORT),
        (UtilityCall(1, "ping"), RequestType.UTILITY),
    ],
)
def test_request_type_byte_names_the_struct(msg, request_type) -> None:
    frames = encode_request(msg)
    assert frames[0] == request_type.value and len(frames[0]) == 1
    assert decode_request(frames) == (request_type, msg)


def test_encoders_refuse_the_wrong_message_class() -> None:
    with pytest.raises(TypeError, match="cannot send EngineCoreOutputs to the engine"):
        encode_request(EngineCoreOutputs())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected EngineCoreOutputs"):
        encode_outputs(AbortRequests([]))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "needs a type frame and a body frame; got 0"),
        ([RequestType.ADD.value], "got 1 frame"),
        ([b"\x09", b"\x90"], r"unknown request type b'\\t'"),
        ([b"", b"\x90"], "unknown request type b''"),
        ([b"\x00\x00", b"\x90"], "unknown request type"),
        ([RequestType.ADD.value, b"\xc1"], "malformed EngineCoreRequest message"),
        ([RequestType.ADD.value, b""], "malformed EngineCoreRequest message"),
        # a valid AbortRequests body sent under the ADD type byte
        ([RequestType.ADD.value, encode_request(AbortRequests(["x"]))[1]], "EngineCoreRequest"),
        ([RequestType.ABORT.value, msgspec.msgpack.encode([["a"], 0]) + b"\x00"], "Abort"),
        ([RequestType.UTILITY.value, msgspec.msgpack.encode(["1", "m"])], "UtilityCall"),
        ([RequestType.ADD.value, object()], "not a buffer|malformed"),
    ],
    ids=[
        "no-frames",
        "no-body",
        "unknown-type",
        "empty-type",
        "long-type",
        "invalid-msgpack",
        "empty-body",
        "wrong-struct",
        "trailing-bytes",
        "wrong-field-type",
        "non-buffer",
    ],
)
def test_malformed_requests_are_protocol_errors(frames, match) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_request(frames)


def test_malformed_outputs_are_protocol_errors() -> None:
    with pytest.raises(ProtocolError, match="needs a body frame"):
        decode_outputs([])
    with pytest.raises(ProtocolError, match="malformed EngineCoreOutputs"):
        decode_outputs([encode_request(AbortRequests(["x"]))[1]])


PICKLED = [
    pickle.dumps(EngineCoreRequest("r", [1, 2])),
    pickle.dumps({"request_id": "r", "prompt_token_ids": [1]}),
    pickle.dumps(["r", [1]], protocol=0),
    pickle.dumps(np.arange(10)),
]


@pytest.mark.parametrize("payload", PICKLED, ids=["struct", "dict", "list-proto0", "ndarray"])
@pytest.mark.parametrize("request_type", list(RequestType), ids=lambda t: t.name)
def test_pickled_request_body_is_refused(payload: bytes, request_type: RequestType) -> None:
    with pytest.raises(ProtocolError):
        decode_request([request_type.value, payload])


@pytest.mark.parametrize("payload", PICKLED, ids=["struct", "dict", "list-proto0", "ndarray"])
def test_pickled_outputs_body_is_refused(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_outputs([payload])


def test_pickle_inside_an_ext_is_refused_for_every_code() -> None:
    payload = pickle.dumps(np.arange(100))
    for code in range(-128, 128):
        ext = msgspec.msgpack.Ext(code, payload)
        # a feature whose data dict holds the Ext, and an output whose pooled value is it
        request = msgspec.msgpack.encode(["r", [1], [["image", "h", "i", [0, 1], {"x": ext}]]])
        outputs = msgspec.msgpack.encode([[["r", [], None, None, [], 0, 0, 0, ext]]])
        with pytest.raises(ProtocolError):
            decode_request([RequestType.ADD.value, request, payload])
        with pytest.raises(ProtocolError):
            decode_outputs([outputs, payload])


class _GatedArray(np.ndarray):
    """An array whose first ``dtype`` read (inside the encoder's hook) pauses its thread."""

    reached: threading.Event
    release: threading.Event

    @property  # type: ignore[override]
    def dtype(self):
        if not _GatedArray.reached.is_set():
            _GatedArray.reached.set()
            assert _GatedArray.release.wait(timeout=30), "the other thread never released us"
        return np.ndarray.dtype.__get__(self)

    @dtype.setter
    def dtype(self, value):  # numpy's own .view() sets it
        np.ndarray.dtype.__set__(self, value)


def test_one_codec_serves_several_threads() -> None:
    """Per-call tensor frames are thread-local: a call that runs entirely while another is
    paused in the middle of its encode must not disturb the paused call's frames."""
    codec = WireCodec()
    gated = np.arange(1000, dtype=np.float32).view(_GatedArray)
    _GatedArray.reached, _GatedArray.release = threading.Event(), threading.Event()
    after = np.full(500, 7, dtype=np.int32)  # its hook runs after the pause
    result: dict[str, object] = {}

    def paused_encode() -> None:
        try:
            result["frames"] = codec.encode({"gated": gated, "after": after})
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=paused_encode)
    thread.start()
    assert _GatedArray.reached.wait(timeout=30)
    other = np.full(300, 3, dtype=np.int64)  # a whole encode + decode while the first waits
    assert np.array_equal(codec.decode(codec.encode({"o": other}), dict)["o"], other)
    _GatedArray.release.set()
    thread.join(timeout=30)
    assert "error" not in result, result.get("error")
    decoded = codec.decode(result["frames"], dict)  # type: ignore[arg-type]
    assert np.array_equal(decoded["after"], after)
    assert np.array_equal(decoded["gated"], np.arange(1000, dtype=np.float32))
