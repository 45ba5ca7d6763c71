"""Drift rate over a sliding window: drift misses / shadow hits, from counter samples.

:class:`DriftWindow` keeps timestamped samples of cumulative counters (read from a source,
usually :func:`counters_of` an :class:`MMISMetrics`) and computes rates from the difference
between the newest sample and the baseline: the newest sample taken at or before the window's
start (or the oldest one, while the window is not yet full). :class:`DriftCollector` exposes
the rate as the ``mmis_drift_rate`` gauge; :meth:`DriftWindow.stats` gives the JSON the
operator probes.

Invariants:
- Time comes from an injected clock (monotonic by default); nothing sleeps or spawns threads.
- Memory is bounded: samples closer than ``window_s / resolution`` to the previous one replace
  the newest sample instead of being appended, and samples older than the baseline are dropped.
- A counter that goes backwards (its source restarted) is treated as reset: its delta is its
  new value, as Prometheus' ``increase()`` does.
- The first sample is taken at construction, so the window covers the process's first
  requests even when nobody asked for stats before them.
- A rate with a zero denominator is 0.0 (no evidence of drift), never NaN or an exception;
  the raw counts are reported beside the rates so a reader can judge the evidence.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mmis.telemetry import catalog
from mmis.telemetry.errors import TelemetryError
from mmis.telemetry.metrics import MMISMetrics

Clock = Callable[[], float]


@dataclasses.dataclass(frozen=True)
class DriftCounters:
    """Cumulative counts at one instant."""

    queries: float = 0.0  # processor (sender) cache lookups
    hits: float = 0.0  # processor (sender) cache hits
    shadow_hits: float = 0.0
    drift_misses: float = 0.0
    requests: float = 0.0
    retries: float = 0.0

    def minus(self, base: DriftCounters) -> DriftCounters:
        deltas = {}
        for field in dataclasses.fields(self):
            now, then = getattr(self, field.name), getattr(base, field.name)
            deltas[field.name] = now - then if now >= then else now
        return DriftCounters(**deltas)


def counters_of(metrics: MMISMetrics) -> Callable[[], DriftCounters]:
    """A source reading the drift-related counters of one process' registry."""

    def read() -> DriftCounters:
        return DriftCounters(
            queries=metrics.total(catalog.PROCESSOR_CACHE_QUERIES),
            hits=metrics.total(catalog.PROCESSOR_CACHE_HITS),
            shadow_hits=metrics.total(catalog.SHADOW_HITS),
            drift_misses=metrics.total(catalog.DRIFT_MISSES),
            requests=metrics.total(catalog.REQUESTS),
            retries=metrics.total(catalog.RETRIES),
        )

    return read


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else 0.0


class DriftWindow:
    def __init__(
        self,
        source: Callable[[], DriftCounters],
        window_s: float = 300.0,
        clock: Clock = time.monotonic,
        resolution: int = 60,
    ) -> None:
        if not window_s > 0:
            raise TelemetryError(f"drift window must be > 0 seconds, got {window_s}")
        if resolution < 1:
            raise TelemetryError(f"drift window resolution must be >= 1, got {resolution}")
        self.window_s = float(window_s)
        self._source = source
        self._clock = clock
        self._min_gap = self.window_s / resolution
        self._samples: collections.deque[tuple[float, DriftCounters]] = collections.deque()
        # the baseline is the start: traffic before the first probe or scrape still counts
        self.sample()

    def __len__(self) -> int:
        return len(self._samples)

    def sample(self) -> None:
        """Read the source now; call it regularly (each scrape and probe also does)."""
        now, counters = self._clock(), self._source()
        samples = self._samples
        if len(samples) >= 2 and now - samples[-2][0] < self._min_gap:
            samples[-1] = (now, counters)
        else:
            samples.append((now, counters))
        start = now - self.window_s
        while len(samples) >= 2 and samples[1][0] <= start:
            samples.popleft()

    def stats(self) -> dict[str, float]:
        """Sample, then the window's rates and counts (the operator's probe body)."""
        self.sample()
        (t0, base), (t1, newest) = self._samples[0], self._samples[-1]
        delta = newest.minus(base)
        return {
            "drift_rate": _ratio(delta.drift_misses, delta.shadow_hits),
            "hit_rate": _ratio(delta.hits, delta.queries),
            "retry_rate": _ratio(delta.retries, delta.requests),
            "window_seconds": self.window_s,
            "span_seconds": t1 - t0,
            "shadow_hits": delta.shadow_hits,
            "drift_misses": delta.drift_misses,
            "queries": delta.queries,
            "retries": delta.retries,
            "requests": delta.requests,
        }


class DriftCollector(Collector):
    """Exposes the window's drift rate as the ``mmis_drift_rate`` gauge at each scrape."""

    def __init__(self, window: DriftWindow, model: str) -> None:
        self._window = window
        self._model = model

    def describe(self) -> Iterator[Metric]:
        spec = catalog.DRIFT_RATE
        yield GaugeMetricFamily(spec.name, spec.help, labels=list(spec.labels))

    def collect(self) -> Iterator[Metric]:
        spec = catalog.DRIFT_RATE
        family = GaugeMetricFamily(spec.name, spec.help, labels=list(spec.labels))
        family.add_metric([self._model], self._window.stats()["drift_rate"])
        yield family
