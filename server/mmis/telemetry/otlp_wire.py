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

import struct
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind

from mmis.telemetry.protobuf_fields import (
    KV_CACHE_MAX,
    attributes,
    field_tag,
    length_delimited,
    string_field,
    uint_field,
    varint,
)

_FIXED64 = struct.Struct("<Q")
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
# Span, Event, Link, Status, scope, resource and request field tags
SPAN_TRACE_ID, SPAN_ID, SPAN_TRACE_STATE, SPAN_PARENT = (field_tag(i, 2) for i in (1, 2, 3, 4))
SPAN_NAME, SPAN_KIND, SPAN_START, SPAN_END = (
    field_tag(5, 2),
    field_tag(6, 0),
    field_tag(7, 1),
    field_tag(8, 1),
)
SPAN_ATTRS, SPAN_DROPPED_ATTRS, SPAN_EVENTS, SPAN_DROPPED_EVENTS = (
    field_tag(9, 2),
    field_tag(10, 0),
    field_tag(11, 2),
    field_tag(12, 0),
)
SPAN_LINKS, SPAN_DROPPED_LINKS, SPAN_STATUS, SPAN_FLAGS = (
    field_tag(13, 2),
    field_tag(14, 0),
    field_tag(15, 2),
    field_tag(16, 5),
)
EVENT_TIME, EVENT_NAME, EVENT_ATTRS, EVENT_DROPPED = (
    field_tag(1, 1),
    field_tag(2, 2),
    field_tag(3, 2),
    field_tag(4, 0),
)
LINK_TRACE_ID, LINK_SPAN_ID, LINK_TRACE_STATE, LINK_ATTRS = (field_tag(i, 2) for i in (1, 2, 3, 4))
LINK_DROPPED, LINK_FLAGS = field_tag(5, 0), field_tag(6, 5)
STATUS_MESSAGE, STATUS_CODE = field_tag(2, 2), field_tag(3, 0)
SCOPE_NAME, SCOPE_VERSION, SCOPE_ATTRS = field_tag(1, 2), field_tag(2, 2), field_tag(3, 2)
SCOPE_SPANS_SCOPE, SCOPE_SPANS_SPANS, SCOPE_SPANS_SCHEMA = (
    field_tag(1, 2),
    field_tag(2, 2),
    field_tag(3, 2),
)
RESOURCE_ATTRS = field_tag(1, 2)
RS_RESOURCE, RS_SCOPE_SPANS, RS_SCHEMA = field_tag(1, 2), field_tag(2, 2), field_tag(3, 2)
REQUEST_RESOURCE_SPANS = field_tag(1, 2)


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
        encoded = string_field(SPAN_NAME, name)
        if len(_NAMES) < KV_CACHE_MAX:
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
        string_field(SPAN_TRACE_STATE, _trace_state(context)) if context.trace_state else b"",
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
    parts.append(uint_field(SPAN_DROPPED_ATTRS, sdk_span.dropped_attributes))
    for event in sdk_span.events:
        body = (
            (EVENT_TIME + _FIXED64.pack(event.timestamp) if event.timestamp else b"")
            + string_field(EVENT_NAME, event.name)
            + attributes(EVENT_ATTRS, event.attributes)
            + uint_field(EVENT_DROPPED, event.dropped_attributes)
        )
        parts.append(length_delimited(SPAN_EVENTS, body))
    parts.append(uint_field(SPAN_DROPPED_EVENTS, sdk_span.dropped_events))
    for link in sdk_span.links:
        body = (
            length_delimited(LINK_TRACE_ID, link.context.trace_id.to_bytes(16, "big"))
            + length_delimited(LINK_SPAN_ID, link.context.span_id.to_bytes(8, "big"))
            + attributes(LINK_ATTRS, link.attributes)
            + uint_field(LINK_DROPPED, link.dropped_attributes)
            + LINK_FLAGS
            + _FIXED32.pack(_flags(link.context))
        )
        parts.append(length_delimited(SPAN_LINKS, body))
    parts.append(uint_field(SPAN_DROPPED_LINKS, sdk_span.dropped_links))
    status = sdk_span.status
    if status.description or status.status_code.value:
        status_body = string_field(STATUS_MESSAGE, status.description) + uint_field(
            STATUS_CODE, status.status_code.value
        )
        parts.append(length_delimited(SPAN_STATUS, status_body))
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
            cached = self._resources[id(resource)] = (resource, length_delimited(RS_RESOURCE, body))
        return cached[1]

    def _scope(self, scope: InstrumentationScope | None) -> bytes:
        cached = self._scopes.get(id(scope))
        if cached is None or cached[0] is not scope:
            body = b""
            if scope is not None:
                body = (
                    string_field(SCOPE_NAME, scope.name)
                    + string_field(SCOPE_VERSION, scope.version)
                    + attributes(SCOPE_ATTRS, scope.attributes)
                )
            cached = self._scopes[id(scope)] = (scope, length_delimited(SCOPE_SPANS_SCOPE, body))
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
            bucket[1].append(length_delimited(SCOPE_SPANS_SPANS, span(sdk_span)))
        out = []
        for resource, by_scope in groups.values():
            body = [self._resource(resource)]
            for scope, encoded in by_scope.values():
                schema = string_field(SCOPE_SPANS_SCHEMA, scope.schema_url if scope else None)
                body.append(
                    length_delimited(
                        RS_SCOPE_SPANS, self._scope(scope) + b"".join(encoded) + schema
                    )
                )
            body.append(string_field(RS_SCHEMA, resource.schema_url))
            out.append(length_delimited(REQUEST_RESOURCE_SPANS, b"".join(body)))
        return b"".join(out)
