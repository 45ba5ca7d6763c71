"""P0's current levels on ``/metrics``, read from the front end's state at each scrape.

:class:`FrontendLevels` renders unlabelled gauges ``mmis_frontend_engine_requests_in_flight``,
``_shadow_entries``, ``_shadow_bytes``, ``_pending_invalidations``, ``_shadow_pending_learned``
(items other P0s stored, heard of and not yet applied), ``_shm_used_bytes``, ``_ready`` and
the counters ``mmis_frontend_epoch_changes_total`` (P1 restarts noticed through a changed
cache epoch), ``_shadow_learned_total`` (items the shadow learned from P1's reports of other
P0s' stores) and ``_shadow_resets_total`` (P1's ``shadow_reset`` flags received). They are
P0-local diagnostics (leak checks), not in the catalog, and duplicate no catalog series.
P0's catalog counters are updated directly on :class:`~mmis.telemetry.metrics.MMISMetrics`
by the code that counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mmis.frontend.client.engine_client import EngineClient
from mmis.frontend.client.pending_invalidations import PendingInvalidations
from mmis.multimodal.cache import SenderCache
from mmis.shm import ShmWriter


class LevelSource(Protocol):
    """What the levels are read from (the front end's state)."""

    @property
    def client(self) -> EngineClient: ...
    @property
    def shadow(self) -> SenderCache: ...
    @property
    def pending(self) -> PendingInvalidations: ...
    @property
    def shm_writer(self) -> ShmWriter | None: ...
    @property
    def ready(self) -> bool: ...
    @property
    def epoch_changes(self) -> int: ...


class FrontendLevels(Collector):
    """P0's current levels and epoch changes, read from the state at each scrape."""

    def __init__(self, state: LevelSource) -> None:
        self._state = state

    def _levels(self) -> dict[str, Callable[[], float]]:
        state = self._state

        def shm_used() -> float:
            writer = state.shm_writer
            if writer is None:
                return 0.0
            writer.reclaim()  # acknowledged extents are free space, not usage (reclaim is lazy)
            return float(writer.stats().used)

        def shm_stat(field: str) -> Callable[[], float]:
            def read() -> float:
                writer = state.shm_writer
                return 0.0 if writer is None else float(getattr(writer.stats(), field))

            return read

        return {
            "engine_requests_in_flight": lambda: state.client.num_in_flight,
            "shadow_entries": lambda: len(state.shadow),
            "shadow_bytes": lambda: state.shadow.stats().total_bytes,
            "pending_invalidations": lambda: len(state.pending),
            "shadow_pending_learned": lambda: len(state.pending.learned()),
            "shm_used_bytes": shm_used,
            # 0 when the store is off or could not be created (frontend/state.py)
            "shm_capacity_bytes": shm_stat("capacity"),
            # extents P1 acknowledged (read) and P0 reclaimed, since start
            "shm_reclaimed_bytes": shm_stat("reclaimed_bytes"),
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
            value=self._state.epoch_changes,
        )
        yield CounterMetricFamily(
            "mmis_frontend_shadow_learned",
            "Items the shadow learned from P1's reports of other P0s' stores.",
            value=self._state.shadow.learned,
        )
        yield CounterMetricFamily(
            "mmis_frontend_shadow_resets",
            "Shadow resets P1 asked for (a new or forgotten client, an overflowed backlog).",
            value=self._state.client.shadow_resets,
        )
