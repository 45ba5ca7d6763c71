"""P0's counters into the process' metrics registry: one sink, and the level gauges.

:class:`MetricsSink` is the :class:`~mmis.frontend.counters.CounterSink` that turns
every :class:`FrontendCounters` increment into the catalog's series
(:class:`~mmis.telemetry.metrics.MMISMetrics`):

==================  ================================================================
counter             series
==================  ================================================================
``shadow_hits``     ``mmis_shadow_hits_total`` and a processor-cache query + hit
``shadow_misses``   a processor-cache query (the item was processed)
``drift_misses``    ``mmis_drift_misses_total``
``invalidations``   ``mmis_shadow_invalidations_total``
``retries``         ``mmis_mm_retries_total{endpoint, outcome}``: endpoint as its route,
                    ``miss_again`` -> ``failed``, ``hash_only`` (refused with a 422, never
                    retried) kept as is; the readiness probe's retries are not client
                    requests: not counted
``epoch_changes``   ``mmis_frontend_epoch_changes_total`` (:class:`FrontendLevels`)
==================  ================================================================

:class:`FrontendLevels` renders, at scrape time, P0's current levels (unlabelled gauges
``mmis_frontend_engine_requests_in_flight``, ``_shadow_entries``, ``_shadow_bytes``,
``_pending_invalidations``, ``_shm_used_bytes``, ``_ready``) and the epoch-change count; they
are P0-local diagnostics (leak checks), not in the catalog, and duplicate no catalog series.

Invariant: every label value that reaches the registry is from a closed set (the catalog
checks it); an unknown endpoint or outcome is dropped, never turned into a label.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mmis.telemetry.metrics import MMISMetrics

if TYPE_CHECKING:
    from mmis.frontend.state import FrontendState

ENDPOINT_ROUTES = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
}
RETRY_OUTCOMES = {
    "success": "success",
    "miss_again": "failed",
    "error": "error",
    "hash_only": "hash_only",
}


class MetricsSink:
    def __init__(self, metrics: MMISMetrics) -> None:
        self.metrics = metrics
        self.epoch_changes = 0

    def increment(self, name: str, labels: Mapping[str, str], amount: int) -> None:
        m = self.metrics
        if name == "shadow_hits":
            m.processor_cache(amount, amount)
            m.shadow_hits(amount)
        elif name == "shadow_misses":
            m.processor_cache(amount, 0)
        elif name == "drift_misses":
            m.drift_misses(amount)
        elif name == "invalidations":
            m.invalidations(amount)
        elif name == "epoch_changes":
            self.epoch_changes += amount
        elif name == "retries":
            route = ENDPOINT_ROUTES.get(labels.get("endpoint", ""))
            outcome = RETRY_OUTCOMES.get(labels.get("outcome", ""))
            if route is not None and outcome is not None:
                for _ in range(amount):
                    m.retry(route, outcome)


class FrontendLevels(Collector):
    """P0's current levels and epoch changes, read from the state at each scrape."""

    def __init__(self, state: FrontendState, sink: MetricsSink) -> None:
        self._state = state
        self._sink = sink

    def _levels(self) -> dict[str, Callable[[], float]]:
        state = self._state

        def shm_used() -> float:
            writer = state.shm_writer
            if writer is None:
                return 0.0
            writer.reclaim()  # acknowledged extents are free space, not usage (reclaim is lazy)
            return float(writer.stats().used)

        return {
            "engine_requests_in_flight": lambda: state.client.num_in_flight,
            "shadow_entries": lambda: len(state.shadow),
            "shadow_bytes": lambda: state.shadow.stats().total_bytes,
            "pending_invalidations": lambda: len(state.pending),
            "shm_used_bytes": shm_used,
            "ready": lambda: int(state.ready),
        }

    def describe(self) -> Iterator[Metric]:
        return iter(())  # collected lazily: the state may change between scrapes

    def collect(self) -> Iterator[Metric]:
        for name, read in self._levels().items():
            yield GaugeMetricFamily(f"mmis_frontend_{name}", f"P0 level: {name}", value=read())
        yield CounterMetricFamily(
            "mmis_frontend_epoch_changes",
            "P1 restarts noticed through a changed cache epoch.",
            value=self._sink.epoch_changes,
        )
