"""The encoder's figures for ``GET /metrics`` on ``--health-port``.

The endpoint itself (``/health`` and ``/metrics``, a daemon thread started once the model is
loaded and the ROUTER bound) is P1's :class:`~mmis.engine.health_server.HealthServer` given
:func:`encoder_registry`; this module is only what the encoder exposes.

Invariants:
- The figures are read at scrape time from the server's counters and cache
  (:class:`EncoderCollector`); names and labels are the catalog's (``telemetry/catalog.py``:
  ``mmis_encoder_items_total{outcome=encoded|cached}``, ``mmis_encoder_cache_bytes``,
  ``mmis_encoder_queue_items``). No request data is ever read.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mmis.engine.encoder.server import EncoderServer
from mmis.telemetry import catalog


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


def encoder_registry(server: EncoderServer, model: str) -> CollectorRegistry:
    """A registry holding only the encoder's figures (what its ``/metrics`` serves)."""
    registry = CollectorRegistry()
    registry.register(EncoderCollector(server, model))
    return registry
