"""CacheCoherent from pods' /stats/cache answers (pure: mmis_operator.status.evaluate)."""

from __future__ import annotations

from typing import Any

import pytest

from mmis_operator.status import ProbeResult, StatsError, evaluate, parse_stats


def body(**over: float) -> dict[str, Any]:
    base: dict[str, Any] = {
        "drift_rate": 0.0,
        "hit_rate": 0.5,
        "retry_rate": 0.0,
        "window_seconds": 3.0,
        "shadow_hits": 10,
        "drift_misses": 0,
        "queries": 20,
        "retries": 0,
        "requests": 20,
        "span_seconds": 3.0,
    }
    base.update(over)
    return base


def pod(name: str, **over: float) -> ProbeResult:
    return ProbeResult(name, stats=parse_stats(body(**over)))


def test_worst_pod_above_threshold_is_drift_rate_high() -> None:
    judged = evaluate(
        [pod("a", drift_rate=0.0), pod("b", drift_rate=0.4, shadow_hits=10, drift_misses=4)],
        threshold=0.05,
    )
    c = judged.condition
    assert (c.type, c.status, c.reason) == ("CacheCoherent", "False", "DriftRateHigh")
    assert "0.4" in c.message and "0.05" in c.message and "pod b" in c.message
    assert judged.cache["worstPod"] == "b"
    assert judged.cache["driftRate"] == 0.2  # pooled: 4 misses / 20 shadow hits
    assert judged.cache["hitRate"] == 0.5
    assert judged.cache["windowSeconds"] == 3.0
    assert (judged.cache["podsProbed"], judged.cache["podsAnswered"]) == (2, 2)


def test_rate_at_or_below_threshold_is_normal() -> None:
    judged = evaluate([pod("a", drift_rate=0.05, drift_misses=1, shadow_hits=20)], 0.05)
    assert (judged.condition.status, judged.condition.reason) == ("True", "DriftRateNormal")
    assert "0.05" in judged.condition.message and "pod a" in judged.condition.message


def test_no_pods_is_unknown_no_data() -> None:
    judged = evaluate([], 0.01)
    assert (judged.condition.status, judged.condition.reason) == ("Unknown", "NoData")
    assert "driftRate" not in judged.cache


def test_no_answer_is_unknown_probe_failed_naming_the_pod() -> None:
    judged = evaluate([ProbeResult("p-1", error="ConnectError: refused")], 0.01)
    assert (judged.condition.status, judged.condition.reason) == ("Unknown", "ProbeFailed")
    assert "p-1: ConnectError: refused" in judged.condition.message
    assert judged.cache == {"podsProbed": 1, "podsAnswered": 0}


def test_some_answers_are_enough_to_judge() -> None:
    judged = evaluate(
        [ProbeResult("dead", error="timeout"), pod("alive", drift_rate=0.5, drift_misses=5)],
        0.1,
    )
    assert judged.condition.reason == "DriftRateHigh"
    assert (judged.cache["podsProbed"], judged.cache["podsAnswered"]) == (2, 1)


def test_no_shadow_hits_is_no_evidence() -> None:
    judged = evaluate([pod("a", shadow_hits=0, drift_misses=0)], 0.01)
    assert (judged.condition.status, judged.condition.reason) == ("Unknown", "NoTraffic")
    assert judged.condition.hold_status  # keeps a stored verdict (test_coherence_idle.py)
    assert "no traffic in the last 3s window" in judged.condition.message
    assert judged.cache["driftRate"] == 0.0  # the Drift column still shows the value


def test_same_answers_give_equal_results() -> None:
    answers = [pod("a", drift_rate=0.123456789, drift_misses=1, shadow_hits=8.1)]
    assert evaluate(answers, 0.01) == evaluate(answers, 0.01)
    assert evaluate(answers, 0.01).cache["driftRate"] == round(1 / 8.1, 4)


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ([1, 2], "JSON object"),
        ({k: v for k, v in body().items() if k != "drift_rate"}, "'drift_rate'"),
        (body(drift_rate=-1.0), "'drift_rate'"),
        (body(queries=float("nan")), "'queries'"),
        ({**body(), "hit_rate": "high"}, "'hit_rate'"),
        ({**body(), "retries": True}, "'retries'"),
    ],
)
def test_malformed_answers_are_stats_errors(bad: Any, words: str) -> None:
    with pytest.raises(StatsError, match=words):
        parse_stats(bad)


def test_threshold_outside_unit_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="threshold"):
        evaluate([], 1.5)
