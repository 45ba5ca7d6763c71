"""The sliding drift window, driven by an injected clock (no sleeps)."""

from __future__ import annotations

import json

import pytest
from prometheus_client import generate_latest

from mmis.telemetry.drift import DriftCollector, DriftCounters, DriftWindow, counters_of
from mmis.telemetry.errors import TelemetryError
from mmis.telemetry.metrics import MMISMetrics

CHAT = "/v1/chat/completions"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(window_s: float = 60.0, resolution: int = 60) -> tuple[MMISMetrics, DriftWindow, Clock]:
    clock = Clock()
    metrics = MMISMetrics("m")
    return metrics, DriftWindow(counters_of(metrics), window_s, clock, resolution), clock


def test_rates_over_the_window_from_real_counters() -> None:
    metrics, window, clock = make()
    window.sample()
    metrics.processor_cache(queries=10, hits=8)
    metrics.shadow_hits(8)
    metrics.drift_misses(2)
    for _ in range(4):
        metrics.request_finished(CHAT, 200, 0.1)
    metrics.retry(CHAT, "success")
    clock.now = 30.0
    stats = window.stats()
    assert stats["drift_rate"] == 0.25
    assert stats["hit_rate"] == 0.8
    assert stats["retry_rate"] == 0.25
    assert stats["shadow_hits"] == 8 and stats["drift_misses"] == 2
    assert stats["window_seconds"] == 60.0
    json.dumps(stats)  # the operator's probe body is plain JSON


def test_old_events_slide_out_of_the_window() -> None:
    metrics, window, clock = make(window_s=60.0)
    window.sample()  # t=0
    metrics.shadow_hits(10)
    metrics.drift_misses(5)  # a burst of drift at the start
    clock.now = 10.0
    window.sample()  # t=10 sees the burst
    clock.now = 40.0
    assert window.stats()["drift_rate"] == 0.5  # still inside the window
    metrics.shadow_hits(10)  # healthy traffic afterwards
    clock.now = 75.0  # the burst (between t=0 and t=10) has left [15, 75]
    stats = window.stats()
    assert stats["drift_misses"] == 0
    assert stats["shadow_hits"] == 10
    assert stats["drift_rate"] == 0.0
    assert stats["span_seconds"] == 65.0  # baseline: newest sample at or before t=15 (t=10)


def test_no_evidence_is_a_zero_rate_not_an_error() -> None:
    _, window, clock = make()
    stats = window.stats()
    assert stats["drift_rate"] == stats["hit_rate"] == stats["retry_rate"] == 0.0
    clock.now = 5.0
    assert window.stats()["shadow_hits"] == 0


def test_a_counter_reset_counts_the_new_value_not_a_negative_delta() -> None:
    readings = iter(
        [
            DriftCounters(shadow_hits=100, drift_misses=50),
            DriftCounters(shadow_hits=4, drift_misses=1),
        ]
    )
    clock = Clock()
    window = DriftWindow(lambda: next(readings), 60.0, clock)  # takes the first reading
    clock.now = 1.0
    stats = window.stats()
    assert stats["shadow_hits"] == 4 and stats["drift_misses"] == 1
    assert stats["drift_rate"] == 0.25


def test_traffic_before_the_first_probe_counts() -> None:
    metrics, window, clock = make(window_s=60.0)
    clock.now = 2.0
    metrics.shadow_hits()  # before anyone asked for stats
    clock.now = 3.0
    assert window.stats()["shadow_hits"] == 1


def test_memory_stays_bounded_when_sampled_on_every_request() -> None:
    metrics, window, clock = make(window_s=60.0, resolution=6)  # at most one sample per 10 s
    for step in range(10_000):
        clock.now = step * 0.1  # 1000 s of sampling ten times a second
        metrics.shadow_hits()
        window.sample()
    assert len(window) <= 6 + 2
    assert window.stats()["shadow_hits"] == pytest.approx(600, abs=100)


def test_the_gauge_exposes_the_window_rate() -> None:
    metrics, window, clock = make()
    metrics.attach(DriftCollector(window, "m"))
    window.sample()
    metrics.shadow_hits(4)
    metrics.drift_misses(1)
    clock.now = 1.0
    text = generate_latest(metrics.registry).decode()
    assert 'mmis_drift_rate{model="m"} 0.25' in text


@pytest.mark.parametrize(("window_s", "resolution"), [(0, 60), (-5, 60), (60, 0)])
def test_bad_window_settings_are_typed_errors(window_s: float, resolution: int) -> None:
    with pytest.raises(TelemetryError):
        DriftWindow(lambda: DriftCounters(), window_s, Clock(), resolution)
