"""The coherence probe: targets, real HTTP fetches, and the status write (fake Kube only)."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from mmis_operator.kube import KubeError
from mmis_operator.probe import OVERRIDE_ANNOTATION, CoherenceProbe, Target, fetch_all, targets
from mmis_operator.status import Coherence, ProbeResult, evaluate, parse_stats

STATS = {
    "drift_rate": 0.5,
    "hit_rate": 0.5,
    "retry_rate": 0.25,
    "window_seconds": 3.0,
    "shadow_hits": 4,
    "drift_misses": 2,
    "queries": 8,
    "retries": 2,
    "requests": 8,
    "span_seconds": 3.0,
}


def _pod(name: str, ip: str | None = "10.0.0.1", ready: bool = True) -> dict[str, Any]:
    cond = {"type": "Ready", "status": "True" if ready else "False"}
    return {"metadata": {"name": name}, "status": {"podIP": ip, "conditions": [cond]}}


def test_targets_are_ready_pods_with_ips(sample: dict[str, Any]) -> None:
    pods = [_pod("b", "10.0.0.2"), _pod("a"), _pod("c", ready=False), _pod("d", ip=None)]
    assert targets(sample, pods, allow_override=False) == [
        Target("a", "http://10.0.0.1:8001/stats/cache"),
        Target("b", "http://10.0.0.2:8001/stats/cache"),
    ]


def test_override_is_ignored_unless_allowed(sample: dict[str, Any]) -> None:
    sample["metadata"]["annotations"] = {OVERRIDE_ANNOTATION: "http://127.0.0.1:9/"}
    pods = [_pod("a"), _pod("b")]
    assert targets(sample, pods, False)[0].url == "http://10.0.0.1:8001/stats/cache"
    assert targets(sample, pods, True) == [Target("a", "http://127.0.0.1:9/stats/cache")]


class _Handler(http.server.BaseHTTPRequestHandler):
    answers: dict[str, tuple[int, bytes]] = {}

    def do_GET(self) -> None:
        code, payload = self.answers.get(self.path, (404, b"{}"))
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


async def test_fetch_all_reports_answers_and_failures(server: str) -> None:
    _Handler.answers = {
        "/good/stats/cache": (200, json.dumps(STATS).encode()),
        "/bad/stats/cache": (200, b'{"drift_rate": "x"}'),
        "/err/stats/cache": (500, b"{}"),
    }
    found = [Target(n, f"{server}/{n}/stats/cache") for n in ("good", "bad", "err")]
    found.append(Target("closed", "http://127.0.0.1:9/stats/cache"))
    results = {r.pod: r for r in await fetch_all(found, timeout=2.0)}
    assert results["good"].stats == parse_stats(STATS)
    assert results["bad"].stats is None and "drift_rate" in (results["bad"].error or "")
    assert results["err"].stats is None and "500" in (results["err"].error or "")
    assert results["closed"].stats is None and results["closed"].error


def _ready_elsewhere(status: dict[str, Any]) -> None:
    foreign = {"type": "Ready", "status": "True", "reason": "AllReplicasReady"}
    status.update({"conditions": [foreign], "readyReplicas": 2})


def _judged(rate: float) -> Coherence:
    stats = {**STATS, "drift_rate": rate, "drift_misses": rate * 4}
    return evaluate([ProbeResult("p", parse_stats(stats))], 0.1)


def test_store_keeps_other_conditions_and_posts_events_only_on_flips(store: Any) -> None:
    store.rival, store.conflicts = _ready_elsewhere, 1
    probe = CoherenceProbe(store)
    probe.store("ml", "llava", _judged(0.5))
    assert (store.tries, store.writes) == (2, 1)
    status = store.obj["status"]
    kinds = {c["type"]: c for c in status["conditions"]}
    assert kinds["Ready"]["reason"] == "AllReplicasReady"  # written by the conflicting writer
    assert status["readyReplicas"] == 2
    assert kinds["CacheCoherent"]["reason"] == "DriftRateHigh"
    assert status["cache"]["driftRate"] == 0.5
    assert store.events == [("Warning", "DriftRateHigh")]
    probe.store("ml", "llava", _judged(0.5))  # nothing changed: no write, no event
    assert (store.writes, len(store.events)) == (1, 1)
    probe.store("ml", "llava", _judged(0.75))  # new rate, same status: write, no event
    assert (store.writes, len(store.events)) == (2, 1)
    probe.store("ml", "llava", _judged(0.0))
    assert store.events[-1] == ("Normal", "DriftRateNormal")
    assert store.obj["status"]["cache"]["driftRate"] == 0.0


def test_store_gives_up_after_persistent_conflicts(store: Any) -> None:
    store.rival, store.conflicts = _ready_elsewhere, 100
    probe = CoherenceProbe(store)
    with pytest.raises(KubeError, match="kept changing"):
        probe.store("ml", "llava", _judged(0.5))


def test_probe_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeout"):
        CoherenceProbe(None, timeout=0)  # type: ignore[arg-type]
