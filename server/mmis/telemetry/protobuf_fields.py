"""Protobuf wire primitives and OTLP ``AnyValue`` / ``KeyValue`` encoding, written by hand.

Used by :mod:`otlp_wire` to write OTLP without building message objects.

Invariants:
- Every function returns the bytes protobuf's own serializer writes for the same message:
  proto3 scalars are omitted when zero or empty (``string_field``, ``uint_field``); a oneof
  member, a sub-message and a repeated element are always written, even when empty.
- ``any_value`` follows the OpenTelemetry SDK encoder's type order (bool before int; None is
  an empty ``AnyValue``) and refuses what protobuf cannot hold (an int outside int64, an
  unknown type) with TypeError/ValueError; ``attributes`` skips and logs such a value.
- The key-value memo only holds scalar values and is bounded (cleared when full).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

_DOUBLE = struct.Struct("<d")
_SMALL = [bytes((i,)) for i in range(128)]


def varint(value: int) -> bytes:
    """Unsigned LEB128; a negative int64 is written as its 64-bit two's complement."""
    if 0 <= value < 128:
        return _SMALL[value]
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while value > 127:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def field_tag(field: int, wire_type: int) -> bytes:
    return varint((field << 3) | wire_type)


def length_delimited(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field."""
    return tag + varint(len(payload)) + payload


def string_field(tag: bytes, text: str | None) -> bytes:
    """A proto3 string field: omitted when empty."""
    return length_delimited(tag, text.encode()) if text else b""


def uint_field(tag: bytes, value: int | None) -> bytes:
    return tag + varint(value) if value else b""


# AnyValue, KeyValue and ArrayValue/KeyValueList field tags
ANY_STRING, ANY_BOOL, ANY_INT = field_tag(1, 2), field_tag(2, 0), field_tag(3, 0)
ANY_DOUBLE, ANY_ARRAY, ANY_KVLIST, ANY_BYTES = (
    field_tag(4, 1),
    field_tag(5, 2),
    field_tag(6, 2),
    field_tag(7, 2),
)
KV_KEY, KV_VALUE, LIST_VALUES = field_tag(1, 2), field_tag(2, 2), field_tag(1, 2)


def any_value(value: Any) -> bytes:
    """An ``AnyValue`` message (the SDK's type order: bool before int; None is empty)."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return ANY_BOOL + (b"\x01" if value else b"\x00")
    if isinstance(value, str):
        return length_delimited(ANY_STRING, value.encode())
    if isinstance(value, int):
        if not -(1 << 63) <= value < 1 << 63:
            raise ValueError(f"integer {value} does not fit an int64")
        return ANY_INT + varint(value)
    if isinstance(value, float):
        return ANY_DOUBLE + _DOUBLE.pack(value)
    if isinstance(value, bytes):
        return length_delimited(ANY_BYTES, value)
    if isinstance(value, Sequence):
        return length_delimited(
            ANY_ARRAY, b"".join(length_delimited(LIST_VALUES, any_value(v)) for v in value)
        )
    if isinstance(value, Mapping):
        pairs = b"".join(
            length_delimited(LIST_VALUES, key_value(str(k), v)) for k, v in value.items()
        )
        return length_delimited(ANY_KVLIST, pairs)
    raise TypeError(f"invalid attribute value type {type(value).__name__}")


def key_value(key: str, value: Any) -> bytes:
    return string_field(KV_KEY, key) + length_delimited(KV_VALUE, any_value(value))


_KV_CACHE: dict[tuple[str, type, Any], bytes] = {}
KV_CACHE_MAX = 4096


def _cached_key_value(key: str, value: Any) -> bytes:
    """``key_value`` memoised for scalar values (names, models, small counts repeat a lot)."""
    if type(value) not in (str, int, bool, float):
        return key_value(key, value)
    cache_key = (key, type(value), value)
    encoded = _KV_CACHE.get(cache_key)
    if encoded is None:
        encoded = key_value(key, value)
        if len(_KV_CACHE) >= KV_CACHE_MAX:
            _KV_CACHE.clear()
        _KV_CACHE[cache_key] = encoded
    return encoded


def attributes(tag: bytes, attrs: Mapping[str, Any] | None) -> bytes:
    """Every attribute as one repeated ``KeyValue`` field ``tag``; bad values are skipped."""
    if not attrs:
        return b""
    parts = []
    for key, value in attrs.items():
        try:
            parts.append(length_delimited(tag, _cached_key_value(key, value)))
        except (TypeError, ValueError) as exc:  # incl. UnicodeEncodeError
            log.error("failed to encode attribute %s: %s", key, exc)
    return b"".join(parts)
