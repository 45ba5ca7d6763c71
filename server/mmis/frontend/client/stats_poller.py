"""Polls P1's figures for ``/metrics``: the ``stats`` and ``receiver_stats`` utility calls.

P1 answers ``stats`` with ``EngineStats(...).to_dict()`` (plus engine details, ignored here)
and ``receiver_stats`` with its receiver cache's counters, which live on P1's input thread;
the poller merges the two into one snapshot for the
:class:`~mmis.telemetry.stats_collector.EngineStatsCollector`.

Invariants:
- One background task polls every ``interval_s``; a scrape calls :meth:`refresh_if_stale`,
  which polls at once when the latest snapshot is older than ``interval_s`` (concurrent
  scrapes share one poll through a lock).
- A failed or timed-out call marks P1 down (``mmis_engine_up 0``, no stale figures); an
  answer that is not a valid snapshot is logged once per kind and also marks it down.
- The poller never raises into the server: a broken P1 only shows in the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from mmis.frontend.client.engine_client import EngineClient
from mmis.protocol.errors import MMISError
from mmis.telemetry.engine_stats import STATS_METHOD
from mmis.telemetry.errors import StatsSnapshotError
from mmis.telemetry.stats_collector import EngineStatsCollector

log = logging.getLogger(__name__)

RECEIVER_METHOD = "receiver_stats"


def receiver_figures(answer: Any) -> dict[str, int]:
    """The receiver-cache part of a snapshot from a ``receiver_stats`` answer."""
    if not isinstance(answer, dict):
        return {}
    hits, misses = int(answer.get("hits", 0)), int(answer.get("misses", 0))
    evictions = int(answer.get("evictions", 0)) + int(answer.get("fault_evictions", 0))
    return {
        "receiver_cache_queries": hits + misses,
        "receiver_cache_hits": hits,
        "receiver_cache_evictions": evictions,
        "receiver_cache_stores": int(answer.get("stored", 0)),
    } | {  # encoder outputs P1 refused, by reason (its receiver_stats carries them)
        key: int(value)
        for key, value in answer.items()
        if key.startswith("encoder_outputs_rejected_")
    }


class StatsPoller:
    def __init__(
        self, client: EngineClient, collector: EngineStatsCollector, interval_s: float = 1.0
    ) -> None:
        self.client = client
        self.collector = collector
        self.interval_s = interval_s
        self.polls = 0
        self._last = float("-inf")
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._warned: set[str] = set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="mmis-stats-poll")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await self.refresh_if_stale()
            await asyncio.sleep(self.interval_s)  # a polling period, not a synchronisation

    async def refresh_if_stale(self) -> None:
        async with self._lock:
            if time.monotonic() - self._last < self.interval_s:
                return
            await self.poll()

    async def poll(self) -> None:
        """One poll now (both calls); updates the collector or marks P1 down."""
        timeout = max(self.interval_s * 2, 1.0)
        try:
            stats, receiver = await asyncio.gather(
                self.client.call_utility(STATS_METHOD, timeout=timeout),
                self.client.call_utility(RECEIVER_METHOD, timeout=timeout),
            )
            if not isinstance(stats, dict):
                raise StatsSnapshotError(f"stats answered {type(stats).__name__}, not a mapping")
            self.collector.update({**stats, **receiver_figures(receiver)})
        except (TimeoutError, MMISError, StatsSnapshotError, ValueError, TypeError) as exc:
            kind = type(exc).__name__
            if kind not in self._warned:
                self._warned.add(kind)
                log.warning("engine stats unavailable (%s: %s); mmis_engine_up=0", kind, exc)
            self.collector.mark_down()
        finally:
            self._last = time.monotonic()
            self.polls += 1
