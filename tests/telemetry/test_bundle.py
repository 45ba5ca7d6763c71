"""P0's telemetry bundle: one scrape shows P0's counters, P1's snapshot and the drift gauge."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from mmis.telemetry.bundle import FrontendTelemetry
from mmis.telemetry.engine_stats import EngineStats


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_one_scrape_shows_all_three_sources() -> None:
    clock = Clock()
    telemetry = FrontendTelemetry.create("tiny", drift_window_s=60, clock=clock)
    telemetry.drift.sample()
    telemetry.metrics.shadow_hits(10)
    telemetry.metrics.drift_misses(1)
    telemetry.engine_stats.update(EngineStats(num_requests_running=3, kv_cache_usage=0.5).to_dict())
    clock.now = 5.0
    body, _ = telemetry.metrics.exposition()
    values = {
        s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples
    }
    assert values["mmis_shadow_hits_total"] == 10
    assert values["mmis_drift_rate"] == 0.1
    assert values["mmis:num_requests_running"] == 3
    assert values["mmis:kv_cache_usage_perc"] == 0.5
    assert values["mmis_engine_up"] == 1
    assert telemetry.drift.stats()["drift_rate"] == 0.1
