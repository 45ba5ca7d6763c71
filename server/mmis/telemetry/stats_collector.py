"""Renders P1's latest stats snapshot into metric families, so P0's ``/metrics`` shows P1.

P0 polls P1 with the ``stats`` utility call and passes each answer to :meth:`update` (or
calls :meth:`mark_down` when the call fails or times out). A scrape then renders the latest
snapshot through every ``Owner.ENGINE`` spec of the catalog, including the Gateway API
inference extension's ``mmis:`` gauges.

Invariants:
- ``mmis_engine_up`` is always exposed: 1 while the latest snapshot is fresher than
  ``stale_after_s`` and no failure was reported since, else 0.
- While the engine is not up, no other engine figure is exposed: a stale queue length or KV
  usage would mislead the endpoint picker and the dashboards.
- A malformed snapshot is rejected at :meth:`update` (typed error) and changes nothing.
- The snapshot is swapped in one reference assignment, so a scrape from another thread sees
  either the old or the new one, never a mix.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mmis.telemetry import catalog
from mmis.telemetry.catalog import Kind, MetricSpec, Owner
from mmis.telemetry.engine_stats import EngineStats
from mmis.telemetry.errors import TelemetryError

Clock = Callable[[], float]
_ENGINE_SPECS = tuple(spec for spec in catalog.ALL if spec.owner is Owner.ENGINE)


class EngineStatsCollector(Collector):
    def __init__(
        self, model: str, stale_after_s: float = 30.0, clock: Clock = time.monotonic
    ) -> None:
        if not model:
            raise TelemetryError("EngineStatsCollector needs the served model's name")
        if stale_after_s <= 0:
            raise TelemetryError(f"stale_after_s must be > 0, got {stale_after_s}")
        self.model = model
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._latest: tuple[EngineStats, float] | None = None

    def update(self, snapshot: Mapping[str, Any]) -> EngineStats:
        """Take a ``stats`` answer (a plain dict); returns the parsed figures."""
        stats = EngineStats.from_dict(snapshot)
        self._latest = (stats, self._clock())
        return stats

    def mark_down(self) -> None:
        """The engine did not answer: report it down until the next good snapshot."""
        self._latest = None

    def current(self) -> EngineStats | None:
        """The latest snapshot if still fresh, else ``None`` (the engine counts as down)."""
        latest = self._latest
        if latest is None:
            return None
        stats, taken_at = latest
        return stats if self._clock() - taken_at <= self.stale_after_s else None

    def describe(self) -> Iterator[Metric]:
        for spec in _ENGINE_SPECS:
            yield _family(spec)

    def collect(self) -> Iterator[Metric]:
        stats = self.current()
        for spec in _ENGINE_SPECS:
            if spec is catalog.ENGINE_UP:
                value = 0.0 if stats is None else 1.0
            elif stats is None or spec.snapshot_key is None:
                continue
            elif spec.snapshot_labels:  # one sample per value of its last label
                family = _family(spec)
                for label, key in zip(spec.snapshot_labels, spec.snapshot_keys, strict=True):
                    family.add_metric([self.model, label], stats.value(key))
                yield family
                continue
            else:
                value = stats.value(spec.snapshot_key)
            family = _family(spec)
            family.add_metric([self.model], value)
            yield family


def _family(spec: MetricSpec) -> CounterMetricFamily | GaugeMetricFamily:
    if spec.kind is Kind.COUNTER:
        return CounterMetricFamily(spec.name, spec.help, labels=list(spec.labels))
    return GaugeMetricFamily(spec.name, spec.help, labels=list(spec.labels))
