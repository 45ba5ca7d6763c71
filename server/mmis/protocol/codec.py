"""The wire codec: msgspec structs <-> ZMQ multipart frames, both directions.

Frame layouts (each item one ZMQ frame, ready for ``send_multipart(frames, copy=False)``):

- P0 -> P1: ``[request_type (1 byte), body, *tensor_frames]`` where the body is the msgpack
  encoding of the :class:`EngineCoreRequest` / :class:`AbortRequests` / :class:`UtilityCall`
  named by the :class:`RequestType` byte.
- P1 -> P0: ``[body, *tensor_frames]`` with an :class:`EngineCoreOutputs` body.

Tensors inside a body are Ext values (see :mod:`mmis.protocol.tensors`); the payload
of a large one is a tensor frame, counted from 0 after the body.

Invariants:
- Encoders and decoders are built once per :class:`WireCodec`; per-call state (the tensor
  frames being written or read) is thread-local, so one codec may serve several threads.
- Every decoding failure -- too few frames, an unknown request-type byte, a body that is
  not valid msgpack for the expected struct (a pickle, for instance), an unknown Ext code,
  a bad tensor frame index or byte length -- raises :class:`ProtocolError`. Nothing here
  unpickles or evaluates anything.
- The encoder copies no tensor payload above the inline threshold; the decoder returns
  arrays that view the received frames, so the frames must outlive the decoded message.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, TypeAlias, TypeVar

import msgspec

from mmis.protocol.errors import ProtocolError
from mmis.protocol.messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestType,
    UtilityCall,
)
from mmis.protocol.tensors import INLINE_THRESHOLD, TensorPacker, TensorUnpacker, is_tensor

T = TypeVar("T")

Frame: TypeAlias = bytes | memoryview
"""An outgoing frame. Incoming frames may be anything with the buffer protocol
(``bytes``, ``bytearray``, ``memoryview``, ``zmq.Frame``)."""

Request: TypeAlias = EngineCoreRequest | AbortRequests | UtilityCall

REQUEST_STRUCTS: dict[RequestType, type[Any]] = {
    RequestType.ADD: EngineCoreRequest,
    RequestType.ABORT: AbortRequests,
    RequestType.UTILITY: UtilityCall,
}
_REQUEST_TYPE_OF: dict[type[Any], RequestType] = {v: k for k, v in REQUEST_STRUCTS.items()}


class WireCodec:
    """Reusable encoder/decoder for every mmis wire message."""

    def __init__(self, inline_threshold: int = INLINE_THRESHOLD) -> None:
        self._packer = TensorPacker(inline_threshold)
        self._unpacker = TensorUnpacker()
        self._local = threading.local()
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}

    # -- generic: any struct, [body, *tensor_frames] -------------------------------------

    def encode(self, msg: Any) -> list[Frame]:
        """``[body, *tensor_frames]`` for any wire struct (or msgpack-able value)."""
        tensor_frames: list[Frame] = []
        self._local.out_frames = tensor_frames
        try:
            body = self._encoder.encode(msg)
        finally:
            self._local.out_frames = None
        return [body, *tensor_frames]

    def decode(self, frames: Sequence[Any], type_: type[T]) -> T:
        """Decode ``[body, *tensor_frames]`` as ``type_``; :class:`ProtocolError` if it is not."""
        if len(frames) < 1:
            raise ProtocolError(f"a {type_.__name__} message needs a body frame; got no frames")
        decoder = self._decoders.get(type_)
        if decoder is None:
            decoder = msgspec.msgpack.Decoder(type_, ext_hook=self._ext_hook)
            self._decoders[type_] = decoder
        self._local.in_frames = frames[1:]
        try:
            return decoder.decode(memoryview(frames[0]))
        except (msgspec.MsgspecError, TypeError) as exc:
            raise ProtocolError(f"malformed {type_.__name__} message: {exc}") from exc
        finally:
            self._local.in_frames = ()

    # -- P0 -> P1 ------------------------------------------------------------------------

    def encode_request(self, msg: Request) -> list[Frame]:
        """``[request_type, body, *tensor_frames]`` for an add, abort or utility request."""
        request_type = _REQUEST_TYPE_OF.get(type(msg))
        if request_type is None:
            raise TypeError(
                f"cannot send {type(msg).__name__} to the engine; expected one of "
                f"{', '.join(t.__name__ for t in REQUEST_STRUCTS.values())}"
            )
        return [request_type.value, *self.encode(msg)]

    def decode_request(self, frames: Sequence[Any]) -> tuple[RequestType, Request]:
        if len(frames) < 2:
            raise ProtocolError(
                f"a request needs a type frame and a body frame; got {len(frames)} frame(s)"
            )
        try:
            first = bytes(memoryview(frames[0]))
        except TypeError as exc:
            raise ProtocolError(f"request type frame is not a buffer: {exc}") from exc
        try:
            request_type = RequestType(first)
        except ValueError:
            known = ", ".join(f"{t.value!r} ({t.name})" for t in RequestType)
            raise ProtocolError(
                f"unknown request type {first[:8]!r}; expected one of {known}"
            ) from None
        return request_type, self.decode(frames[1:], REQUEST_STRUCTS[request_type])

    # -- P1 -> P0 ------------------------------------------------------------------------

    def encode_outputs(self, outputs: EngineCoreOutputs) -> list[Frame]:
        if not isinstance(outputs, EngineCoreOutputs):
            raise TypeError(f"expected EngineCoreOutputs, got {type(outputs).__name__}")
        return self.encode(outputs)

    def decode_outputs(self, frames: Sequence[Any]) -> EngineCoreOutputs:
        return self.decode(frames, EngineCoreOutputs)

    # -- hooks -----------------------------------------------------------------------------

    def _enc_hook(self, obj: Any) -> Any:
        if is_tensor(obj):
            return self._packer.pack(obj, self._local.out_frames)
        raise ProtocolError(
            f"cannot encode a {type(obj).__module__}.{type(obj).__qualname__} on the wire; "
            "use wire structs, builtins, numpy arrays or torch tensors"
        )

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        return self._unpacker.unpack(code, data, self._local.in_frames)


_DEFAULT = WireCodec()

encode = _DEFAULT.encode
decode = _DEFAULT.decode
encode_request = _DEFAULT.encode_request
decode_request = _DEFAULT.decode_request
encode_outputs = _DEFAULT.encode_outputs
decode_outputs = _DEFAULT.decode_outputs
