"""The real OTLP exporters, each against a real receiver on loopback (HTTP and gRPC)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

sys.path.insert(0, str(Path(__file__).parent))
from otlp_receiver import serve_otlp_http, service_spans

from mmis.telemetry.tracing import CACHE_MISS, record_cache_event, setup_tracing
from mmis.telemetry.tracing_config import TracingConfig

Request = trace_service_pb2.ExportTraceServiceRequest


class Received:
    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.paths: list[str] = []
        self.arrived = threading.Event()

    def add(self, request: Request, path: str) -> None:
        self.requests.append(request)
        self.paths.append(path)
        self.arrived.set()

    def spans(self) -> list[tuple[str, str, list[str]]]:
        """(service.name, span name, event names) of everything received."""
        return [
            (service, span.name, [event.name for event in span.events])
            for request in self.requests
            for service, span in service_spans(request)
        ]


@pytest.fixture
def http_receiver() -> Iterator[tuple[str, Received]]:
    received = Received()
    with serve_otlp_http(received.add) as base:
        yield base, received


@pytest.fixture
def grpc_receiver() -> Iterator[tuple[str, Received]]:
    received = Received()

    class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Request, context: grpc.ServicerContext) -> object:
            received.add(request, "grpc")
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}", received
    finally:
        server.stop(grace=None).wait(timeout=10)


def _send_one_trace(config: TracingConfig) -> None:
    tracing = setup_tracing(config)
    assert tracing.enabled
    try:
        with tracing.tracer.start_as_current_span("chat tiny") as span:
            record_cache_event(span, CACHE_MISS, hashes_count=3, attempt=1, outcome="retrying")
        assert tracing.force_flush(timeout_ms=30_000)
    finally:
        tracing.shutdown()


def test_http_exporter_delivers_spans(http_receiver: tuple[str, Received]) -> None:
    base, received = http_receiver
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": base, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    config = TracingConfig.from_env(env, service_name="mmis-frontend")
    _send_one_trace(config)
    assert received.arrived.wait(timeout=30)
    assert received.paths == ["/v1/traces"]
    assert received.spans() == [("mmis-frontend", "chat tiny", [CACHE_MISS])]


def test_grpc_exporter_delivers_spans(grpc_receiver: tuple[str, Received]) -> None:
    endpoint, received = grpc_receiver
    config = TracingConfig.from_env({}, otlp_traces_endpoint=endpoint, service_name="mmis-engine")
    assert config.protocol == "grpc"
    _send_one_trace(config)
    assert received.arrived.wait(timeout=30)
    assert received.spans() == [("mmis-engine", "chat tiny", [CACHE_MISS])]
