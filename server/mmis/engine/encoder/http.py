"""The encoder's probe and scrape endpoint: ``GET /health`` and ``GET /metrics`` on
``--health-port``.

Invariants:
- A daemon thread of its own (``http.server``), started once the model is loaded and the
  ROUTER bound: a 200 on ``/health`` means "loaded and serving" (503 when ``alive`` says
  otherwise; ``mmis encoder`` runs its loop on the main thread, so a loop that ends ends the
  process).
- ``/metrics`` is the Prometheus text format of the encoder's figures, read at scrape time
  from its counters and cache (:class:`EncoderCollector`); names and labels are the
  catalog's (``telemetry/catalog.py``: ``mmis_encoder_items_total{outcome=encoded|cached}``,
  ``mmis_encoder_cache_bytes``, ``mmis_encoder_queue_items``). Anything else is a 404. No
  request data is ever read.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mmis.engine.encoder.server import EncoderServer
from mmis.telemetry import catalog

log = logging.getLogger("mmis.encoder")

ITEM_OUTCOMES = ("encoded", "cached")


class EncoderCollector(Collector):
    """The encoder's figures, read from ``server`` at each scrape."""

    def __init__(self, server: EncoderServer, model: str) -> None:
        self._server = server
        self._model = model

    def collect(self) -> Iterable[Metric]:
        spec = catalog.ENCODER_ITEMS
        items = CounterMetricFamily(
            spec.name.removesuffix("_total"), spec.help, labels=list(spec.labels)
        )
        counters = self._server.counters
        items.add_metric([self._model, "encoded"], counters.encoded)
        items.add_metric([self._model, "cached"], counters.cached)
        size = GaugeMetricFamily(
            catalog.ENCODER_CACHE_BYTES.name,
            catalog.ENCODER_CACHE_BYTES.help,
            labels=list(catalog.ENCODER_CACHE_BYTES.labels),
        )
        size.add_metric([self._model], self._server.cache.bytes)
        queue = GaugeMetricFamily(
            catalog.ENCODER_QUEUE_ITEMS.name,
            catalog.ENCODER_QUEUE_ITEMS.help,
            labels=list(catalog.ENCODER_QUEUE_ITEMS.labels),
        )
        queue.add_metric([self._model], self._server.waiting)
        return [items, size, queue]


class EncoderHTTP:
    def __init__(
        self, host: str, port: int, alive: Callable[[], bool], registry: CollectorRegistry
    ) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/health":
                    ok = alive()
                    body = b'{"status": "ok"}' if ok else b'{"status": "the encoder loop died"}'
                    self._answer(200 if ok else 503, body, "application/json")
                elif self.path == "/metrics":
                    self._answer(200, generate_latest(registry), "text/plain; version=0.0.4")
                else:
                    self._answer(404, b'{"status": "not found"}', "application/json")

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
            target=self._server.serve_forever, name="mmis-encoder-http", daemon=True
        )

    def start(self) -> EncoderHTTP:
        self._thread.start()
        log.info("encoder health and metrics on port %d", self.port)
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
