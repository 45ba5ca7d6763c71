"""P1's stats snapshot: its dict form over the real wire codec, and its rendering in P0."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from mmis.protocol import EngineCoreOutputs, UtilityResult, WireCodec
from mmis.telemetry.engine_stats import STATS_METHOD, EngineStats
from mmis.telemetry.errors import StatsSnapshotError, TelemetryError
from mmis.telemetry.metrics import MMISMetrics
from mmis.telemetry.stats_collector import EngineStatsCollector


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def engine_answer(stats: EngineStats) -> dict[str, object]:
    """What P0 gets back from P1's `stats` utility call, through the real codec."""
    codec = WireCodec()
    sent = EngineCoreOutputs(
        utility_result=UtilityResult(call_id=7, ok=True, result=stats.to_dict())
    )
    received = codec.decode_outputs(codec.encode_outputs(sent))
    assert received.utility_result is not None
    result = received.utility_result.result
    assert isinstance(result, dict)
    return result


def scrape(registry: CollectorRegistry) -> dict[str, float]:
    from prometheus_client import generate_latest

    text = generate_latest(registry).decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_snapshot_reaches_p0_metrics_through_the_wire() -> None:
    stats = EngineStats(
        num_requests_waiting=4,
        num_requests_running=3,
        kv_cache_usage=0.25,
        encoder_cache_queries=10,
        encoder_cache_hits=6,
        encoder_cache_evictions=2,
        prefix_cache_queries=100,
        prefix_cache_hits=64,
        receiver_cache_queries=9,
        receiver_cache_hits=8,
        receiver_cache_evictions=1,
    )
    metrics = MMISMetrics("m")
    collector = EngineStatsCollector("m")
    metrics.attach(collector)
    assert collector.update(engine_answer(stats)) == stats
    seen = scrape(metrics.registry)
    assert seen["mmis_engine_up"] == 1
    assert seen["mmis:num_requests_waiting"] == seen["mmis_num_requests_waiting"] == 4
    assert seen["mmis:num_requests_running"] == seen["mmis_num_requests_running"] == 3
    assert seen["mmis:kv_cache_usage_perc"] == seen["mmis_kv_cache_usage_perc"] == 0.25
    assert seen["mmis_encoder_cache_hits_total"] == 6
    assert seen["mmis_prefix_cache_hits_total"] == 64
    assert seen["mmis_receiver_cache_evictions_total"] == 1
    assert STATS_METHOD == "stats"


def test_stale_or_failed_engine_reports_down_and_hides_its_figures() -> None:
    clock = Clock()
    registry = CollectorRegistry()
    collector = EngineStatsCollector("m", stale_after_s=30, clock=clock)
    registry.register(collector)
    assert scrape(registry) == {"mmis_engine_up": 0}  # nothing heard yet
    collector.update({"num_requests_waiting": 5})
    clock.now += 30
    assert scrape(registry)["mmis:num_requests_waiting"] == 5
    clock.now += 0.5
    assert scrape(registry) == {"mmis_engine_up": 0}  # stale: no stale queue length either
    collector.update({"num_requests_waiting": 1})
    assert scrape(registry)["mmis_engine_up"] == 1
    collector.mark_down()
    assert scrape(registry) == {"mmis_engine_up": 0}


def test_snapshot_is_compatible_both_ways() -> None:
    newer = {**EngineStats(num_requests_running=2).to_dict(), "some_future_figure": 9}
    assert EngineStats.from_dict(newer) == EngineStats(num_requests_running=2)
    older = {"num_requests_running": 2}  # an older P1 that reports fewer figures
    assert EngineStats.from_dict(older).kv_cache_usage == 0.0


@pytest.mark.parametrize(
    ("snapshot", "match"),
    [
        (["num_requests_waiting", 1], "mapping"),
        ({"num_requests_waiting": "3"}, "must be a number"),
        ({"num_requests_waiting": True}, "must be a number"),
        ({"encoder_cache_hits": -1}, ">= 0"),
        ({"kv_cache_usage": math.nan}, "finite"),
        ({"kv_cache_usage": 1.5}, "above 1"),
        ({"prefix_cache_queries": 1, "prefix_cache_hits": 2}, "exceeds"),
    ],
)
def test_malformed_snapshot_is_rejected_and_changes_nothing(snapshot: object, match: str) -> None:
    collector = EngineStatsCollector("m")
    collector.update({"num_requests_waiting": 7})
    with pytest.raises(StatsSnapshotError, match=match):
        collector.update(snapshot)  # type: ignore[arg-type]
    current = collector.current()
    assert current is not None and current.num_requests_waiting == 7


def test_collector_names_are_checked_for_collisions() -> None:
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector("m"))
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        registry.register(EngineStatsCollector("m"))


def test_bad_construction_is_a_typed_error() -> None:
    with pytest.raises(TelemetryError):
        EngineStatsCollector("")
    with pytest.raises(TelemetryError):
        EngineStatsCollector("m", stale_after_s=0)
