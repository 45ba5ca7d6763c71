"""Tensors on the wire: numpy arrays (and torch tensors) as msgpack Ext values.

A tensor travels as ``Ext(TENSOR_EXT_CODE, header)`` where ``header`` is the msgpack array
``[dtype_name, shape, data]`` and ``data`` is either the raw bytes (payloads smaller than
the inline threshold) or the index of a separate *tensor frame* that carries the raw bytes.

Invariants:
- Only the dtypes in :data:`WIRE_DTYPES` cross the wire, always little-endian and
  C-contiguous. Object, string and structured arrays are refused; nothing is pickled.
- Encoding a C-contiguous array above the threshold copies nothing: the frame is a
  ``memoryview`` over the array's own buffer, so the array must stay unchanged until the
  frames are sent. Non-contiguous or big-endian arrays are converted first (one copy).
- Decoding copies nothing for frame-carried tensors: the array is ``np.frombuffer`` over
  the received frame (read-only when the frame is). The byte length must match
  ``dtype.itemsize * prod(shape)`` exactly, else :class:`ProtocolError`.
- torch is never imported to encode (a torch tensor can only exist once torch is loaded)
  and is imported only to decode a ``bfloat16`` tensor. torch tensors decode as numpy
  arrays, except ``bfloat16`` (numpy lacks it), which travels as its raw 16-bit payload and
  decodes as a ``torch.bfloat16`` tensor (copied first if the frame is read-only, since
  torch cannot wrap read-only memory).
- Tensor frame indices count from 0 within the tensor frames of one message (the frames
  after the body). Unreferenced frames are tolerated: an older decoder skips a newer
  message's trailing fields, and the tensors those fields referenced, without reading them.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from mmis.protocol.errors import ProtocolError

TENSOR_EXT_CODE = 1
"""The only msgpack Ext code mmis defines. Any other code is a :class:`ProtocolError`, except
-1, msgpack's standard timestamp, which msgspec itself decodes (a valid one, to datetime)."""

INLINE_THRESHOLD = 256
"""Payloads of fewer bytes than this ride inline in the body; larger ones get a frame."""

BFLOAT16 = "bfloat16"

WIRE_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(name).newbyteorder("<")
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
}
"""Wire dtype name -> numpy dtype (little-endian). ``bfloat16`` travels as raw uint16."""

_BF16_CARRIER = WIRE_DTYPES["uint16"]


class TensorHeader(msgspec.Struct, array_like=True, frozen=True):
    """The Ext payload of one tensor. ``data``: inline bytes or a tensor frame index."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes | int


def _torch_module() -> Any:
    """torch if it is already imported; a torch tensor cannot exist otherwise."""
    return sys.modules.get("torch")


def is_tensor(obj: object) -> bool:
    """True for numpy arrays and (without importing torch) torch tensors."""
    if isinstance(obj, np.ndarray):
        return True
    torch = _torch_module()
    return torch is not None and isinstance(obj, torch.Tensor)


def _as_wire_array(obj: Any) -> tuple[str, np.ndarray]:
    """(wire dtype name, little-endian C-contiguous array holding the raw payload)."""
    torch = _torch_module()
    if torch is not None and isinstance(obj, torch.Tensor):
        tensor = obj.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.resolve_conj().resolve_neg().contiguous()
        if tensor.dtype == torch.bfloat16:
            return BFLOAT16, tensor.view(torch.uint16).numpy()
        try:
            obj = tensor.numpy()
        except TypeError as exc:
            raise ProtocolError(f"cannot encode a torch tensor of dtype {tensor.dtype}") from exc
    if not isinstance(obj, np.ndarray):
        raise ProtocolError(f"cannot encode {type(obj).__name__} as a tensor")
    name = obj.dtype.name
    if name not in WIRE_DTYPES or obj.dtype.fields is not None:
        raise ProtocolError(
            f"cannot encode an array of dtype {obj.dtype!s}; "
            f"allowed: {', '.join([*WIRE_DTYPES, BFLOAT16])}"
        )
    if obj.dtype.byteorder == ">":
        obj = obj.astype(WIRE_DTYPES[name])
    if not obj.flags.c_contiguous:
        obj = np.ascontiguousarray(obj)
    return name, obj


class TensorPacker:
    """Turns a tensor into an Ext value, appending large payloads to ``frames``."""

    def __init__(self, inline_threshold: int = INLINE_THRESHOLD) -> None:
        if inline_threshold < 0:
            raise ValueError(f"inline_threshold must be >= 0, got {inline_threshold}")
        self.inline_threshold = inline_threshold
        self._encoder = msgspec.msgpack.Encoder()

    def pack(self, obj: Any, frames: list[bytes | memoryview]) -> msgspec.msgpack.Ext:
        name, arr = _as_wire_array(obj)
        data: bytes | int
        if arr.nbytes < self.inline_threshold:
            data = arr.tobytes()
        else:
            data = len(frames)
            # a flat uint8 view of the array's own memory: zero-copy
            frames.append(arr.reshape(-1).view(np.uint8).data)
        header = TensorHeader(dtype=name, shape=tuple(arr.shape), data=data)
        return msgspec.msgpack.Ext(TENSOR_EXT_CODE, self._encoder.encode(header))


class TensorUnpacker:
    """Turns an Ext value back into an array, reading frame-carried payloads in place."""

    def __init__(self) -> None:
        self._decoder = msgspec.msgpack.Decoder(TensorHeader)

    def unpack(self, code: int, payload: memoryview, frames: Sequence[Any]) -> Any:
        if code != TENSOR_EXT_CODE:
            raise ProtocolError(
                f"unknown msgpack ext code {code}; only tensors (code {TENSOR_EXT_CODE}) "
                "are accepted"
            )
        try:
            header = self._decoder.decode(payload)
        except msgspec.MsgspecError as exc:
            raise ProtocolError(f"malformed tensor header: {exc}") from exc
        is_bf16 = header.dtype == BFLOAT16
        dtype = _BF16_CARRIER if is_bf16 else WIRE_DTYPES.get(header.dtype)
        if dtype is None:
            raise ProtocolError(f"tensor has unsupported dtype {header.dtype!r}")
        if any(dim < 0 for dim in header.shape):
            raise ProtocolError(f"tensor has a negative dimension in shape {header.shape}")
        expected = math.prod(header.shape) * dtype.itemsize
        buffer = self._payload_buffer(header.data, frames)
        if buffer.nbytes != expected:
            raise ProtocolError(
                f"tensor of dtype {header.dtype} and shape {list(header.shape)} needs "
                f"{expected} bytes, got {buffer.nbytes}"
            )
        if is_bf16 and buffer.readonly:
            buffer = memoryview(bytearray(buffer))  # torch refuses read-only memory
        if expected == 0:
            arr = np.empty(header.shape, dtype=dtype)
        else:
            arr = np.frombuffer(buffer, dtype=dtype).reshape(header.shape)
        if is_bf16:
            import torch

            return torch.from_numpy(arr).view(torch.bfloat16)
        return arr

    @staticmethod
    def _payload_buffer(data: bytes | int, frames: Sequence[Any]) -> memoryview:
        if isinstance(data, bytes):
            return memoryview(data)
        if not 0 <= data < len(frames):
            raise ProtocolError(
                f"tensor refers to frame {data}, but the message has {len(frames)} tensor frame(s)"
            )
        try:
            view = memoryview(frames[data])
            return view if view.format == "B" and view.ndim == 1 else view.cast("B")
        except TypeError as exc:
            raise ProtocolError(f"tensor frame {data} is not a contiguous buffer: {exc}") from exc
