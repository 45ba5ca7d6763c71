"""The probe (and scrape) endpoint of P1 and of ``mmis encoder``: ``GET /health`` on
``--health-port``, and ``GET /metrics`` where a registry is given (the encoder's:
``engine/encoder/metrics.py``). One owner for both processes.

Kubelet probes each container of a pod on its own (``operator/mmis_operator/builders.py``): the
engine container's startup, readiness and liveness probes hit this endpoint, so a hung or
stopped engine is restarted itself, and the front end's liveness (its ``GET /health``) is about
the front end only.

Invariants:
- Served by a daemon thread of its own (``http.server``), started after the model is loaded
  and the KV cache allocated, so a 200 means "loaded and running": the startup probe waits
  for it. It answers while the busy loop is inside a long step (a big prefill is not a
  hang); it does not answer when the process is stopped (SIGSTOP) or gone, and answers 503
  once one of the engine's threads (input, busy loop, output) has died.
- Nothing but ``GET /health`` and, with ``registry``, ``GET /metrics`` (the Prometheus text
  format, read at scrape time); 404 otherwise. No request data, no engine state is read but
  thread liveness (and the registry's collectors), so it cannot slow the engine down.
- ``/health`` answers ``{"status": "ok"}`` (200) or ``{"status": <down>}`` (503): ``down`` names
  what died, per process.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)

PATH = "/health"
METRICS_PATH = "/metrics"
JSON = "application/json"


class HealthServer:
    def __init__(
        self,
        host: str,
        port: int,
        alive: Callable[[], bool],
        *,
        registry: CollectorRegistry | None = None,
        down: str = "an engine thread died",
        name: str = "engine",
    ) -> None:
        self._alive = alive
        self._name = name
        down_body = json.dumps({"status": down}).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == PATH:
                    if alive():
                        self._answer(200, b'{"status": "ok"}', JSON)
                    else:
                        self._answer(503, down_body, JSON)
                elif self.path == METRICS_PATH and registry is not None:
                    from prometheus_client import generate_latest

                    self._answer(200, generate_latest(registry), "text/plain; version=0.0.4")
                else:
                    self._answer(404, b'{"status": "not found"}', JSON)

            def _answer(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:  # probes every few seconds: no log
                return

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=f"mmis-{name}-health", daemon=True
        )
        self._paths = PATH if registry is None else f"{PATH}, {METRICS_PATH}"

    def start(self) -> HealthServer:
        self._thread.start()
        log.info("%s health endpoint on port %d (%s)", self._name, self.port, self._paths)
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
