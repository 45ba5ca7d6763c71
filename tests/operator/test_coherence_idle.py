"""CacheCoherent of an idle service: no flapping through Unknown, no Event spam.

A probe whose pods answer with no shadow hit in the window (no traffic reusing images) is
``NoTraffic``: it keeps the stored True/False verdict (message: since when, and the last
verdict), or is ``Unknown`` where no verdict was ever given, and posts no Event. Driven
through the real judge (:func:`status.evaluate`) and the real status write
(:meth:`CoherenceProbe.store`) against the in-memory resource store (conftest.FakeStore).
"""

from __future__ import annotations

import re
from typing import Any

from mmis_operator import status
from mmis_operator.probe import CoherenceProbe

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"
STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"


def judged(shadow_hits: float, misses: float = 0.0, failed: bool = False) -> status.Coherence:
    if failed:
        return status.evaluate([status.ProbeResult("p", error="ConnectError")], 0.1)
    answer = {
        "drift_rate": misses / shadow_hits if shadow_hits else 0.0,
        "hit_rate": 0.5,
        "retry_rate": 0.0,
        "window_seconds": 300.0,
        "shadow_hits": shadow_hits,
        "drift_misses": misses,
        "queries": 2 * shadow_hits,
        "retries": misses,
        "requests": 2 * shadow_hits,
    }
    return status.evaluate([status.ProbeResult("p", status.parse_stats(answer))], 0.1)


BUSY, IDLE, DRIFTING = judged(10), judged(0), judged(10, misses=5)


def coherent(store: Any) -> dict[str, Any]:
    found = status.find(store.obj["status"]["conditions"], "CacheCoherent")
    assert found is not None
    return dict(found)


def test_true_then_idle_then_true_keeps_the_verdict_without_an_event(
    store: Any,
) -> None:
    probe = CoherenceProbe(store)
    probe.store("ml", "llava", BUSY)
    verdict = coherent(store)
    assert (verdict["status"], verdict["reason"]) == ("True", "DriftRateNormal")
    assert store.events == [("Normal", "DriftRateNormal")]
    probe.store("ml", "llava", IDLE)
    idle = coherent(store)
    assert (idle["status"], idle["reason"]) == ("True", "NoTraffic")
    assert idle["lastTransitionTime"] == verdict["lastTransitionTime"]
    assert re.search(rf"no traffic in the last 300s window.* \(since {STAMP}\)", idle["message"])
    assert f"last verdict DriftRateNormal: {verdict['message']}" in idle["message"]
    writes = store.writes
    probe.store("ml", "llava", IDLE)  # still idle: nothing to rewrite, "since" stays
    assert (store.writes, coherent(store)) == (writes, idle)
    probe.store("ml", "llava", BUSY)
    back = coherent(store)
    assert (back["status"], back["reason"]) == ("True", "DriftRateNormal")
    assert back["lastTransitionTime"] == verdict["lastTransitionTime"]
    assert store.events == [("Normal", "DriftRateNormal")]  # no Event for idle and back


def test_fresh_then_idle_is_unknown_no_traffic_without_an_event(store: Any) -> None:
    probe = CoherenceProbe(store)
    probe.store("ml", "llava", IDLE)
    idle = coherent(store)
    assert (idle["status"], idle["reason"]) == ("Unknown", "NoTraffic")
    assert re.search(rf"\(since {STAMP}\)$", idle["message"])
    assert store.events == []
    probe.store("ml", "llava", BUSY)  # the first real verdict is a transition
    assert coherent(store)["status"] == "True"
    assert store.events == [("Normal", "DriftRateNormal")]


def test_a_drifting_service_that_goes_idle_stays_false(store: Any) -> None:
    probe = CoherenceProbe(store)
    probe.store("ml", "llava", DRIFTING)
    probe.store("ml", "llava", IDLE)
    idle = coherent(store)
    assert (idle["status"], idle["reason"]) == ("False", "NoTraffic")
    assert "last verdict DriftRateHigh: drift rate 0.5" in idle["message"]
    assert store.events == [("Warning", "DriftRateHigh")]
    probe.store("ml", "llava", BUSY)
    assert store.events[-1] == ("Normal", "DriftRateNormal")


def test_idle_after_a_failed_probe_stays_unknown_without_an_event(
    store: Any,
) -> None:
    probe = CoherenceProbe(store)
    probe.store("ml", "llava", judged(0, failed=True))
    probe.store("ml", "llava", IDLE)
    assert (coherent(store)["status"], coherent(store)["reason"]) == ("Unknown", "NoTraffic")
    assert store.events == [("Warning", "ProbeFailed")]


def test_held_condition_text_and_times_are_exact() -> None:
    verdict = status.upsert([], BUSY.condition, 3, T0)
    idle = status.upsert(verdict, IDLE.condition, 3, T1)
    assert idle[0]["lastTransitionTime"] == T0
    assert idle[0]["message"] == (
        f"{IDLE.condition.message} (since {T1}); "
        f"last verdict DriftRateNormal: {BUSY.condition.message}"
    )
    assert status.upsert(idle, IDLE.condition, 3, "2026-01-01T01:00:00Z") == idle
    assert status.transitions(verdict, [IDLE.condition]) == []
    assert status.transitions([], [IDLE.condition]) == []


def test_cache_coherent_stays_out_of_ready(sample: dict[str, Any]) -> None:
    deployment = {
        "metadata": {"generation": 1},
        "spec": {"replicas": 2},
        "status": {
            "replicas": 2,
            "readyReplicas": 2,
            "updatedReplicas": 2,
            "observedGeneration": 1,
        },
    }
    held_false = status.upsert(status.upsert([], DRIFTING.condition, 3, T0), IDLE.condition, 3, T1)
    merged = status.merged_status(
        {"conditions": held_false}, status.desired_status(sample, deployment), 3, now=T1
    )
    kinds = {c["type"]: c for c in merged["conditions"]}
    assert kinds["Ready"]["status"] == "True"
    assert kinds["CacheCoherent"] == held_false[0]
