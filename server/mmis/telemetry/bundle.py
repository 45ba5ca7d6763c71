"""P0's telemetry in one object: the registry, P1's stats collector and the drift window.

The front end creates one :class:`FrontendTelemetry` per process at start-up and then:

- records its own figures through ``metrics`` (cache lookups, shadow hits, drift misses,
  invalidations, retries, finished requests, TTFT / TPOT);
- feeds every answer of P1's ``stats`` utility call to ``engine_stats.update`` (and calls
  ``engine_stats.mark_down()`` when the call fails);
- calls ``drift.sample()`` now and then (each scrape and probe samples too);
- serves ``metrics.exposition(accept)`` on ``/metrics`` and ``drift.stats()`` as the JSON
  the operator probes.

Invariant: everything is registered in the one private registry of ``metrics``; the
``mmis_drift_rate`` gauge and P1's figures appear in the same scrape as P0's own counters.
"""

from __future__ import annotations

import dataclasses
import time

from mmis.telemetry.drift import Clock, DriftCollector, DriftWindow, counters_of
from mmis.telemetry.metrics import MMISMetrics
from mmis.telemetry.stats_collector import EngineStatsCollector


@dataclasses.dataclass(frozen=True)
class FrontendTelemetry:
    metrics: MMISMetrics
    engine_stats: EngineStatsCollector
    drift: DriftWindow

    @classmethod
    def create(
        cls,
        model: str,
        drift_window_s: float = 300.0,
        stats_stale_after_s: float = 30.0,
        clock: Clock = time.monotonic,
    ) -> FrontendTelemetry:
        metrics = MMISMetrics(model)
        engine_stats = EngineStatsCollector(model, stats_stale_after_s, clock)
        drift = DriftWindow(counters_of(metrics), drift_window_s, clock)
        metrics.attach(engine_stats)
        metrics.attach(DriftCollector(drift, model))
        return cls(metrics=metrics, engine_stats=engine_stats, drift=drift)
