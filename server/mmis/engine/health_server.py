"""P1's own probe endpoint: ``GET /health`` on ``--health-port``, for the engine container.

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
- Nothing but ``GET /health`` (404 otherwise); no request data, no engine state is read but
  thread liveness, so it cannot slow the engine down.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)

PATH = "/health"


class HealthServer:
    def __init__(self, host: str, port: int, alive: Callable[[], bool]) -> None:
        self._alive = alive

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path != PATH:
                    self._answer(404, b'{"status": "not found"}')
                elif alive():
                    self._answer(200, b'{"status": "ok"}')
                else:
                    self._answer(503, b'{"status": "an engine thread died"}')

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:  # probes every few seconds: no log
                return

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="mmis-engine-health", daemon=True
        )

    def start(self) -> HealthServer:
        self._thread.start()
        log.info("engine health endpoint on port %d (%s)", self.port, PATH)
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
