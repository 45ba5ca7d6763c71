"""The in-segment format of one payload: a dict of numpy arrays behind a small header.

Layout of one allocation (all offsets relative to its start)::

    [u32 magic][u32 header_len][msgpack header][pad to 64][array 0][pad][array 1]...

The header is a msgpack list of ``[name, dtype, shape, data_offset, nbytes]`` entries, with
``data_offset`` relative to the first 64-byte boundary after the header.

Invariants:
- Only numeric and boolean dtypes (kinds ``b i u f c``) are stored; object, string and
  structured arrays are refused with :class:`ShmPayloadError`, so nothing is ever pickled.
  A ``torch.bfloat16`` tensor (an encoder output on a GPU model, ``protocol/encoder.py``;
  numpy has no bfloat16) is stored as its raw 16-bit payload under the dtype name
  :data:`BFLOAT16` and read back as a ``torch.bfloat16`` tensor (always a copy: torch cannot
  wrap read-only memory), as ``protocol/tensors.py`` carries it on the wire; torch is imported
  only to read such an entry.
- Arrays are copied straight into the mapping (one copy in), and read back as read-only
  numpy views over the mapping (zero copies out) unless the caller asks for a copy.
- Decoding validates every offset, size and dtype against the allocation: a corrupt header
  raises :class:`ShmPayloadError`, never reads outside the payload.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from mmis.shm.errors import ShmPayloadError
from mmis.shm.layout import ALIGN, align_up

PAYLOAD_MAGIC = 0x4D4D5031  # "MMP1"
_PREFIX = struct.Struct("<II")
_KINDS = frozenset("biufc")
BFLOAT16 = "bfloat16"
_BF16_CARRIER = np.dtype("<u2")

Entry = tuple[str, str, tuple[int, ...], int, int]


@dataclass(frozen=True)
class Plan:
    """What to write: the encoded header and each array's place; ``size`` is the total."""

    header: bytes
    arrays: list[tuple[int, npt.NDArray[Any]]]  # (offset from allocation start, array)
    size: int


def plan(payload: Mapping[str, Any]) -> Plan:
    """Validate ``payload`` and compute its layout, without touching shared memory."""
    if not isinstance(payload, Mapping) or not payload:
        raise ShmPayloadError("an SHM payload must be a non-empty mapping of name -> array")
    entries: list[list[Any]] = []
    arrays: list[npt.NDArray[Any]] = []
    rel = 0
    for name, value in payload.items():
        if not isinstance(name, str):
            raise ShmPayloadError(f"payload keys must be str, got {type(name).__name__}")
        dtype_name = None
        try:
            if _is_bfloat16(value):
                arr, dtype_name = _bf16_bits(value), BFLOAT16
            else:
                arr = np.asarray(value)
        except Exception as exc:  # e.g. a GPU tensor that cannot be viewed from the CPU
            raise ShmPayloadError(f"payload item {name!r} is not an array: {exc}") from exc
        if arr.dtype.kind not in _KINDS or arr.dtype.fields is not None:
            raise ShmPayloadError(
                f"payload item {name!r} has dtype {arr.dtype}; only numeric/bool arrays are stored"
            )
        entries.append([name, dtype_name or arr.dtype.str, list(arr.shape), rel, arr.nbytes])
        arrays.append(arr)
        rel = align_up(rel + arr.nbytes)
    header = msgspec.msgpack.encode(entries)
    base = align_up(_PREFIX.size + len(header))
    placed = [(base + int(e[3]), a) for e, a in zip(entries, arrays, strict=True)]
    return Plan(header=header, arrays=placed, size=max(base + rel, ALIGN))


def _is_bfloat16(value: Any) -> bool:
    """A ``torch.bfloat16`` tensor, told without importing torch (one cannot exist otherwise)."""
    return type(value).__module__.startswith("torch") and str(getattr(value, "dtype", "")) == (
        "torch.bfloat16"
    )


def _bf16_bits(tensor: Any) -> npt.NDArray[Any]:
    """The raw 16-bit payload of a CPU ``torch.bfloat16`` tensor as a little-endian uint16 array."""
    import torch

    bits = tensor.detach().cpu().contiguous().view(torch.int16).numpy()
    return bits.view(_BF16_CARRIER)


def write(buf: mmap.mmap, start: int, p: Plan) -> None:
    """Copy the header and arrays of ``p`` into ``buf`` at ``start`` (one copy per array)."""
    _PREFIX.pack_into(buf, start, PAYLOAD_MAGIC, len(p.header))
    buf[start + _PREFIX.size : start + _PREFIX.size + len(p.header)] = p.header
    for rel, arr in p.arrays:
        if arr.nbytes == 0:
            continue
        dest: npt.NDArray[Any] = np.ndarray(
            arr.shape, dtype=arr.dtype, buffer=buf, offset=start + rel
        )
        np.copyto(dest, arr, casting="no")


def _entries(raw: bytes) -> list[Entry]:
    try:
        decoded = msgspec.msgpack.decode(raw, type=list[tuple[str, str, list[int], int, int]])
    except msgspec.DecodeError as exc:
        raise ShmPayloadError(f"corrupt SHM payload header: {exc}") from exc
    return [(n, d, tuple(s), o, b) for n, d, s, o, b in decoded]


def read(buf: mmap.mmap, start: int, length: int, copy: bool) -> dict[str, Any]:
    """Decode the payload at ``buf[start:start+length]`` into arrays.

    With ``copy=False`` the arrays are read-only views over ``buf``: valid until the
    descriptor is acknowledged. With ``copy=True`` they own their memory.
    """
    if length < _PREFIX.size:
        raise ShmPayloadError("SHM payload shorter than its prefix")
    magic, header_len = _PREFIX.unpack_from(buf, start)
    if magic != PAYLOAD_MAGIC or _PREFIX.size + header_len > length:
        raise ShmPayloadError("corrupt SHM payload prefix")
    head = start + _PREFIX.size
    entries = _entries(bytes(buf[head : head + header_len]))
    base = align_up(_PREFIX.size + header_len)
    out: dict[str, Any] = {}
    for name, dtype_str, shape, rel, nbytes in entries:
        try:
            dtype = _BF16_CARRIER if dtype_str == BFLOAT16 else np.dtype(dtype_str)
        except TypeError as exc:
            raise ShmPayloadError(f"corrupt dtype {dtype_str!r} for {name!r}") from exc
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if (
            dtype.kind not in _KINDS
            or dtype.fields is not None
            or min(shape, default=0) < 0
            or rel < 0
            or count * dtype.itemsize != nbytes
            or base + rel + nbytes > length
        ):
            raise ShmPayloadError(f"corrupt SHM payload entry {name!r}")
        view: npt.NDArray[Any] = np.ndarray(
            shape, dtype=dtype, buffer=buf, offset=start + base + rel
        )
        if dtype_str == BFLOAT16:
            import torch

            out[name] = torch.from_numpy(view.view("<i2").copy()).view(torch.bfloat16)
        elif copy:
            out[name] = view.copy()
        else:
            view.flags.writeable = False
            out[name] = view
    return out
