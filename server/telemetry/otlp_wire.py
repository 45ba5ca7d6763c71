"""OTLP trace encoding straight to protobuf wire bytes, without building message objects.

The OpenTelemetry exporters build one protobuf message object per span, key-value and value
before serialising; for the few small spans of a request that is most of what tracing costs
a process. :func:`encode_request` writes the same ``ExportTraceServiceRequest`` directly.

Invariants:
- The output is byte-for-byte what ``encode_spans(spans).SerializeToString()`` gives for the
  same spans (fields in field-number order, proto3 defaults omitted, oneof members and
  repeated elements always written); a test compares the two over varied spans.
- Spans are grouped by resource, then by instrumentation scope, in first-seen order; the
  encoded resource and scope headers are cached per object (they never change in a process).
- An attribute value of an unsupported type is skipped and logged, as the SDK encoder does;
  nothing raises for user data.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind

log = logging.getLogger(__name__)

_FIXED64 = struct.Struct("<Q")
_DOUBLE = struct.Struct("<d")
_FIXED32 = struct.Struct("<I")
_KIND = {
    SpanKind.INTERNAL: 1,
    SpanKind.SERVER: 2,
    SpanKind.CLIENT: 3,
    SpanKind.PRODUCER: 4,
    SpanKind.CONSUMER: 5,
}
_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200
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


def _tag(field: int, wire_type: int) -> bytes:
    return varint((field << 3) | wire_type)


def _ld(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field."""
    return tag + varint(len(payload)) + payload


def _str(tag: bytes, text: str | None) -> bytes:
    """A proto3 string field: omitted when empty."""
    return _ld(tag, text.encode()) if text else b""


def _uint(tag: bytes, value: int | None) -> bytes:
    return tag + varint(value) if value else b""


# field tags by message, named <message>_<field>
ANY_STRING, ANY_BOOL, ANY_INT = _tag(1, 2), _tag(2, 0), _tag(3, 0)
ANY_DOUBLE, ANY_ARRAY, ANY_KVLIST, ANY_BYTES = _tag(4, 1), _tag(5, 2), _tag(6, 2), _tag(7, 2)
KV_KEY, KV_VALUE, LIST_VALUES = _tag(1, 2), _tag(2, 2), _tag(1, 2)
SPAN_TRACE_ID, SPAN_ID, SPAN_TRACE_STATE, SPAN_PARENT = (_tag(i, 2) for i in (1, 2, 3, 4))
SPAN_NAME, SPAN_KIND, SPAN_START, SPAN_END = _tag(5, 2), _tag(6, 0), _tag(7, 1), _tag(8, 1)
SPAN_ATTRS, SPAN_DROPPED_ATTRS, SPAN_EVENTS, SPAN_DROPPED_EVENTS = (
    _tag(9, 2),
    _tag(10, 0),
    _tag(11, 2),
    _tag(12, 0),
)
SPAN_LINKS, SPAN_DROPPED_LINKS, SPAN_STATUS, SPAN_FLAGS = (
    _tag(13, 2),
    _tag(14, 0),
    _tag(15, 2),
    _tag(16, 5),
)
EVENT_TIME, EVENT_NAME, EVENT_ATTRS, EVENT_DROPPED = _tag(1, 1), _tag(2, 2), _tag(3, 2), _tag(4, 0)
LINK_TRACE_ID, LINK_SPAN_ID, LINK_TRACE_STATE, LINK_ATTRS = (_tag(i, 2) for i in (1, 2, 3, 4))
LINK_DROPPED, LINK_FLAGS = _tag(5, 0), _tag(6, 5)
STATUS_MESSAGE, STATUS_CODE = _tag(2, 2), _tag(3, 0)
SCOPE_NAME, SCOPE_VERSION, SCOPE_ATTRS = _tag(1, 2), _tag(2, 2), _tag(3, 2)
SCOPE_SPANS_SCOPE, SCOPE_SPANS_SPANS, SCOPE_SPANS_SCHEMA = _tag(1, 2), _tag(2, 2), _tag(3, 2)
RESOURCE_ATTRS = _tag(1, 2)
RS_RESOURCE, RS_SCOPE_SPANS, RS_SCHEMA = _tag(1, 2), _tag(2, 2), _tag(3, 2)
REQUEST_RESOURCE_SPANS = _tag(1, 2)


def any_value(value: Any) -> bytes:
    """An ``AnyValue`` message (the SDK's type order: bool before int; None is empty)."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return ANY_BOOL + (b"\x01" if value else b"\x00")
    if isinstance(value, str):
        return _ld(ANY_STRING, value.encode())
    if isinstance(value, int):
        if not -(1 << 63) <= value < 1 << 63:
            raise ValueError(f"integer {value} does not fit an int64")
        return ANY_INT + varint(value)
    if isinstance(value, float):
        return ANY_DOUBLE + _DOUBLE.pack(value)
    if isinstance(value, bytes):
        return _ld(ANY_BYTES, value)
    if isinstance(value, Sequence):
        return _ld(ANY_ARRAY, b"".join(_ld(LIST_VALUES, any_value(v)) for v in value))
    if isinstance(value, Mapping):
        pairs = b"".join(_ld(LIST_VALUES, key_value(str(k), v)) for k, v in value.items())
        return _ld(ANY_KVLIST, pairs)
    raise TypeError(f"invalid attribute value type {type(value).__name__}")


def key_value(key: str, value: Any) -> bytes:
    return _str(KV_KEY, key) + _ld(KV_VALUE, any_value(value))


_KV_CACHE: dict[tuple[str, type, Any], bytes] = {}
_KV_CACHE_MAX = 4096


def _cached_key_value(key: str, value: Any) -> bytes:
    """``key_value`` memoised for scalar values (names, models, small counts repeat a lot)."""
    if type(value) not in (str, int, bool, float):
        return key_value(key, value)
    cache_key = (key, type(value), value)
    encoded = _KV_CACHE.get(cache_key)
    if encoded is None:
        encoded = key_value(key, value)
        if len(_KV_CACHE) >= _KV_CACHE_MAX:
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
            parts.append(_ld(tag, _cached_key_value(key, value)))
        except (TypeError, ValueError) as exc:  # incl. UnicodeEncodeError
            log.error("failed to encode attribute %s: %s", key, exc)
    return b"".join(parts)


def _flags(parent: SpanContext | None) -> int:
    remote = parent is not None and parent.is_remote
    return _HAS_IS_REMOTE | _IS_REMOTE if remote else _HAS_IS_REMOTE


def _trace_state(context: SpanContext) -> str:
    state = context.trace_state
    return ",".join(f"{k}={v}" for k, v in state.items()) if state else ""


# constant pieces of the common span, precomputed (the per-span work is the hot path)
_IDS = struct.Struct(">QQQ")  # trace id (two halves) and span id, big-endian like the SDK
_TIMES = struct.Struct("<BQBQ")  # start and end tags (one byte each) with their fixed64
_IDS_PREFIX = SPAN_TRACE_ID + b"\x10"
_SPAN_ID_PREFIX = SPAN_ID + b"\x08"
_PARENT_PREFIX = SPAN_PARENT + b"\x08"
_KIND_FIELD = {kind: SPAN_KIND + varint(number) for kind, number in _KIND.items()}
_UNSET_STATUS = SPAN_STATUS + b"\x00"
_FLAGS_FIELD = {
    remote: SPAN_FLAGS + _FIXED32.pack(_HAS_IS_REMOTE | (_IS_REMOTE if remote else 0))
    for remote in (False, True)
}
_NAMES: dict[str, bytes] = {}


def _name(name: str) -> bytes:
    encoded = _NAMES.get(name)
    if encoded is None:
        encoded = _str(SPAN_NAME, name)
        if len(_NAMES) < _KV_CACHE_MAX:
            _NAMES[name] = encoded
    return encoded


def span(sdk_span: ReadableSpan) -> bytes:
    """One ``Span`` message."""
    context = sdk_span.get_span_context()
    if context is None:  # never for an SDK span; guards a foreign ReadableSpan
        raise TypeError(f"span {sdk_span.name!r} has no span context")
    parent = sdk_span.parent
    trace_id = context.trace_id
    ids = _IDS.pack(trace_id >> 64, trace_id & 0xFFFFFFFFFFFFFFFF, context.span_id)
    start, end = sdk_span.start_time, sdk_span.end_time
    parts = [
        _IDS_PREFIX,
        ids[:16],
        _SPAN_ID_PREFIX,
        ids[16:],
        _str(SPAN_TRACE_STATE, _trace_state(context)) if context.trace_state else b"",
        _PARENT_PREFIX + parent.span_id.to_bytes(8, "big") if parent else b"",
        _name(sdk_span.name),
        _KIND_FIELD[sdk_span.kind],
    ]
    if start and end:
        parts.append(_TIMES.pack(SPAN_START[0], start, SPAN_END[0], end))
    else:
        parts.append(SPAN_START + _FIXED64.pack(start) if start else b"")
        parts.append(SPAN_END + _FIXED64.pack(end) if end else b"")
    parts.append(attributes(SPAN_ATTRS, sdk_span.attributes))
    parts.append(_uint(SPAN_DROPPED_ATTRS, sdk_span.dropped_attributes))
    for event in sdk_span.events:
        body = (
            (EVENT_TIME + _FIXED64.pack(event.timestamp) if event.timestamp else b"")
            + _str(EVENT_NAME, event.name)
            + attributes(EVENT_ATTRS, event.attributes)
            + _uint(EVENT_DROPPED, event.dropped_attributes)
        )
        parts.append(_ld(SPAN_EVENTS, body))
    parts.append(_uint(SPAN_DROPPED_EVENTS, sdk_span.dropped_events))
    for link in sdk_span.links:
        body = (
            _ld(LINK_TRACE_ID, link.context.trace_id.to_bytes(16, "big"))
            + _ld(LINK_SPAN_ID, link.context.span_id.to_bytes(8, "big"))
            + attributes(LINK_ATTRS, link.attributes)
            + _uint(LINK_DROPPED, link.dropped_attributes)
            + LINK_FLAGS
            + _FIXED32.pack(_flags(link.context))
        )
        parts.append(_ld(SPAN_LINKS, body))
    parts.append(_uint(SPAN_DROPPED_LINKS, sdk_span.dropped_links))
    status = sdk_span.status
    if status.description or status.status_code.value:
        status_body = _str(STATUS_MESSAGE, status.description) + _uint(
            STATUS_CODE, status.status_code.value
        )
        parts.append(_ld(SPAN_STATUS, status_body))
    else:
        parts.append(_UNSET_STATUS)
    parts.append(_FLAGS_FIELD[parent is not None and parent.is_remote])
    return b"".join(parts)


class Encoder:
    """Encodes batches of SDK spans; caches each resource's and scope's encoded header."""

    def __init__(self) -> None:
        self._resources: dict[int, tuple[Resource, bytes]] = {}
        self._scopes: dict[int, tuple[InstrumentationScope | None, bytes]] = {}

    def _resource(self, resource: Resource) -> bytes:
        cached = self._resources.get(id(resource))
        if cached is None or cached[0] is not resource:
            body = attributes(RESOURCE_ATTRS, resource.attributes)
            cached = self._resources[id(resource)] = (resource, _ld(RS_RESOURCE, body))
        return cached[1]

    def _scope(self, scope: InstrumentationScope | None) -> bytes:
        cached = self._scopes.get(id(scope))
        if cached is None or cached[0] is not scope:
            body = b""
            if scope is not None:
                body = (
                    _str(SCOPE_NAME, scope.name)
                    + _str(SCOPE_VERSION, scope.version)
                    + attributes(SCOPE_ATTRS, scope.attributes)
                )
            cached = self._scopes[id(scope)] = (scope, _ld(SCOPE_SPANS_SCOPE, body))
        return cached[1]

    def encode_request(self, spans: Sequence[ReadableSpan]) -> bytes:
        """A serialized ``ExportTraceServiceRequest`` holding ``spans``."""
        # grouped by identity: hashing a Resource serialises its attributes every time
        groups: dict[int, tuple[Resource, dict[int, tuple[Any, list[bytes]]]]] = {}
        for sdk_span in spans:
            resource = sdk_span.resource
            scopes = groups.get(id(resource))
            if scopes is None:
                scopes = groups[id(resource)] = (resource, {})
            scope = sdk_span.instrumentation_scope or None
            bucket = scopes[1].get(id(scope))
            if bucket is None:
                bucket = scopes[1][id(scope)] = (scope, [])
            bucket[1].append(_ld(SCOPE_SPANS_SPANS, span(sdk_span)))
        out = []
        for resource, by_scope in groups.values():
            body = [self._resource(resource)]
            for scope, encoded in by_scope.values():
                schema = _str(SCOPE_SPANS_SCHEMA, scope.schema_url if scope else None)
                body.append(_ld(RS_SCOPE_SPANS, self._scope(scope) + b"".join(encoded) + schema))
            body.append(_str(RS_SCHEMA, resource.schema_url))
            out.append(_ld(REQUEST_RESOURCE_SPANS, b"".join(body)))
        return b"".join(out)
