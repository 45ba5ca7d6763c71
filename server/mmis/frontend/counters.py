"""P0's in-process counters of the cache and recovery chain, with a hook for exporters.

Counter names (what each counts):

- ``shadow_hits``: items sent without data because the shadow said P1 holds them;
- ``shadow_misses``: items the renderer had to process (not in the shadow, or bypassed);
- ``drift_misses``: hashes P1 reported missing (each one a shadow hit P1 no longer held);
- ``invalidations``: hashes queued for dropping from the shadow (misses and evictions);
- ``epoch_changes``: P1 restarts noticed through a changed cache epoch;
- ``retries``: labelled ``endpoint`` (chat | completions | embeddings | ready) and
  ``outcome`` (``success``, ``miss_again``, ``hash_only``, ``error``): one per request whose
  first attempt failed in a retryable way (``hash_only``: refused without a retry).

Invariants:
- Counting never raises into the request path: a failing sink is logged and skipped.
- ``snapshot()`` is a consistent copy (taken under the lock); values only ever grow.
- Exporters (Prometheus, OpenTelemetry) attach through :meth:`FrontendCounters.add_sink`
  and receive every increment with its labels; this module imports no exporter.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Protocol

log = logging.getLogger(__name__)

Labels = tuple[tuple[str, str], ...]

COUNTER_NAMES: tuple[str, ...] = (
    "shadow_hits",
    "shadow_misses",
    "drift_misses",
    "invalidations",
    "epoch_changes",
    "retries",
)


class CounterSink(Protocol):
    """Receives every increment (e.g. a Prometheus or OpenTelemetry adapter)."""

    def increment(self, name: str, labels: Mapping[str, str], amount: int) -> None: ...


class FrontendCounters:
    """Thread-safe monotonically growing counters, optionally labelled."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[str, Labels], int] = {}
        self._sinks: list[CounterSink] = []

    def add_sink(self, sink: CounterSink) -> None:
        with self._lock:
            self._sinks.append(sink)

    def inc(self, name: str, amount: int = 1, **labels: str) -> None:
        if name not in COUNTER_NAMES:
            raise KeyError(f"unknown counter {name!r}; known: {', '.join(COUNTER_NAMES)}")
        if amount < 0:
            raise ValueError(f"counters only grow; got an increment of {amount}")
        if amount == 0:
            return
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount
            sinks = list(self._sinks)
        for sink in sinks:
            try:
                sink.increment(name, labels, amount)
            except Exception:  # a broken exporter must never fail a request
                log.exception("counter sink %r failed on %s", sink, name)

    def get(self, name: str, **labels: str) -> int:
        """The sum over every series of ``name`` whose labels include ``labels``."""
        wanted = set(labels.items())
        with self._lock:
            return sum(v for (n, ls), v in self._values.items() if n == name and wanted <= set(ls))

    def snapshot(self) -> dict[str, dict[Labels, int]]:
        """Every series: ``{name: {labels: value}}`` (unlabelled series under ``()``)."""
        out: dict[str, dict[Labels, int]] = {name: {} for name in COUNTER_NAMES}
        with self._lock:
            for (name, labels), value in self._values.items():
                out[name][labels] = value
        return out
