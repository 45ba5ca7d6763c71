"""The OTLP/gRPC span exporter with :mod:`otlp_wire`'s encoder in place of the SDK's.

Everything but the encoding (endpoint and ``OTEL_EXPORTER_OTLP_*`` handling, credentials,
compression, retries with backoff, reconnection) is the OpenTelemetry exporter's own; only
its documented ``_translate_data`` hook is replaced, and the request it returns is parsed
from bytes that equal the SDK encoder's output (see :mod:`otlp_wire`), so the collector
receives exactly what it would have.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan

from mmis.telemetry.otlp_wire import Encoder


class GrpcSpanExporter(OTLPSpanExporter):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._encoder = Encoder()

    def _translate_data(self, data: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
        return ExportTraceServiceRequest.FromString(self._encoder.encode_request(data))
