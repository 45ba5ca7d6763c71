"""A minimal OTLP/HTTP traces receiver on loopback, shared by the exporter and e2e tests.

- :func:`serve_otlp_http` runs an HTTP server on ``127.0.0.1:0`` for the ``with`` block and
  yields its base URL (``http://127.0.0.1:PORT``; exporters post to ``/v1/traces``). Every
  POST body is decoded as an ``ExportTraceServiceRequest`` and handed to ``on_export`` with
  the request path *before* the 200 reply (an empty ``ExportTraceServiceResponse``) goes out,
  so once an exporter's flush returns, what it sent has been recorded. ``on_export`` runs on
  the server's handler threads: it must be thread-safe. The server is shut down and its
  thread joined on exit.
- :func:`service_spans` flattens one export request into ``(service.name, span)`` pairs.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

ExportRequest = trace_service_pb2.ExportTraceServiceRequest


@contextmanager
def serve_otlp_http(on_export: Callable[[ExportRequest, str], None]) -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            on_export(ExportRequest.FromString(body), self.path)
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def service_spans(request: ExportRequest) -> Iterator[tuple[str, trace_pb2.Span]]:
    """Every span of ``request`` with the ``service.name`` of its resource."""
    for resource_spans in request.resource_spans:
        attributes = resource_spans.resource.attributes
        service = next(a.value.string_value for a in attributes if a.key == "service.name")
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                yield service, span
