"""CacheCoherent against the real control plane, with a real ``mmis`` server as the endpoint.

kwok runs the service's pod with a fake IP, so the resource carries the test-only
``mmis.dev/stats-endpoints`` annotation (honoured because this operator is started with
``allow_stats_endpoint_override``) pointing the probe at a real ``mmis engine`` +
``mmis frontend`` pair on the tiny model, with a 3 s drift window. The engine's fault knob is
turned at runtime through its real utility socket (``set_fault_evict_rate``), exactly the
wire P0 speaks, while a client thread keeps re-sending the same images (shadow hits).
Every wait polls an observable state with a deadline.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import operator_kit as ok
import pytest
import zmq
from kubecluster import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from procs import Engine, Frontend, chat_body

from mmis.protocol.codec import WireCodec
from mmis.protocol.messages import UtilityCall
from mmis.tiny_models.tiny_model import tiny_model_dir
from mmis_operator.main import OperatorThread, Options

pytestmark = [pytest.mark.controlplane, pytest.mark.model, pytest.mark.slow]

THRESHOLD = 0.05
COLORS = [(200, 10, 10), (10, 200, 10), (10, 10, 200)]
KNOB_CLIENT = 7  # the knob's own topic; P0 is client 0


class FaultKnob:
    """Sets P1's fault-evict rate through its utility socket (PUSH in, SUB on ``c7``)."""

    def __init__(self, engine: Engine) -> None:
        self.codec = WireCodec()
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(engine.input_address)
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"c%d" % KNOB_CLIENT)
        self.sub.connect(engine.output_address)
        self.call_id = 0

    def set(self, rate: float, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # resent until answered: a SUB may join late
            self.call_id += 1
            call = UtilityCall(self.call_id, "set_fault_evict_rate", [rate], KNOB_CLIENT)
            self.push.send_multipart(self.codec.encode_request(call))
            if self.sub.poll(500):
                frames = self.sub.recv_multipart()
                result = self.codec.decode_outputs(frames[1:]).utility_result
                if result is not None and result.ok and result.result == rate:
                    return
        raise TimeoutError(f"the engine did not acknowledge fault rate {rate}")

    def close(self) -> None:
        self.push.close(linger=0)
        self.sub.close(linger=0)
        self.ctx.term()


class Traffic:
    """Re-sends the same images until stopped, so every window holds shadow hits."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=120) as http:
            while not self.stop.is_set():
                for color in COLORS:
                    url = self.frontend.base_url + "/chat/completions"
                    response = http.post(url, json=chat_body(color, max_tokens=2))
                    if response.status_code != 200:
                        self.failures.append(response.text[:300])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(180)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Engine, Frontend]]:
    model = tiny_model_dir()
    engine = Engine("engine", model, tmp_path)
    try:
        frontend = Frontend("frontend", model, engine, tmp_path, "--drift-window-s", "3")
        try:
            frontend.wait_ready()
            yield engine, frontend
        finally:
            frontend.stop()
    finally:
        engine.stop()


def _coherent(obj: dict[str, Any]) -> dict[str, Any]:
    for condition in (obj.get("status") or {}).get("conditions") or ():
        if condition["type"] == "CacheCoherent":
            return dict(condition)
    return {}


def _poll(what: str, fetch: Callable[[], dict[str, Any]], ok: Callable[[dict[str, Any]], bool],
          timeout: float = 120.0) -> dict[str, Any]:  # fmt: skip
    deadline = time.monotonic() + timeout
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        last = fetch()
        if ok(last):
            return last
        time.sleep(0.5)  # polling the API server's state, not a synchronisation
    pytest.fail(f"timed out waiting for {what}; last status: {json.dumps(last.get('status'))}")


@pytest.mark.timeout(900)
def test_fault_knob_flips_cache_coherent_and_back(
    cluster: Cluster, crd: None, namespace: str, stack: tuple[Engine, Frontend]
) -> None:
    engine, frontend = stack
    options = Options(
        namespaces=(namespace,),
        resync_seconds=600.0,
        watch_server_timeout=20,
        watch_client_timeout=30.0,
        request_timeout=30.0,
        probe_seconds=1.0,
        allow_stats_endpoint_override=True,
    )
    resource = {
        "apiVersion": "mmis.dev/v1alpha1",
        "kind": "MMInferenceService",
        "metadata": {
            "name": "tiny",
            "annotations": {"mmis.dev/stats-endpoints": frontend.root_url},
        },
        "spec": {
            "model": {"id": "llava-hf/llava-1.5-7b-hf"},
            "replicas": 1,
            "resources": {"gpus": 1, "memory": "8Gi"},
            "cache": {"type": "lru", "size": "1Gi", "driftThreshold": THRESHOLD},
        },
    }
    knob = FaultKnob(engine)
    traffic = Traffic(frontend)

    def fetch() -> dict[str, Any]:
        return ok.get(cluster, namespace, "mmis/tiny")

    with OperatorThread(cluster.kubeconfig, options) as running:
        try:
            traffic.thread.start()
            cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(resource))
            (pod,) = _poll(
                "a running pod",
                lambda: ok.get(cluster, namespace, "pods"),
                lambda pods: len(pods["items"]) == 1,
            )["items"]
            pod_name = pod["metadata"]["name"]

            knob.set(1.0)
            high = _poll("DriftRateHigh", fetch, lambda o: _coherent(o).get("status") == "False")
            condition = _coherent(high)
            assert condition["reason"] == "DriftRateHigh"
            rate = high["status"]["cache"]["driftRate"]
            assert rate > THRESHOLD
            assert f"pod {pod_name}" in condition["message"]
            assert f"threshold {THRESHOLD:g}" in condition["message"]
            assert "drift rate " in condition["message"]
            assert _coherent(high)["status"] == "False"
            assert {c["type"] for c in high["status"]["conditions"]} >= {"Ready", "CacheCoherent"}
            table = cluster.kubectl("get", "-n", namespace, "mmis/tiny").stdout.splitlines()
            column = table[0].split().index("DRIFT")
            assert float(table[1].split()[column]) > THRESHOLD

            knob.set(0.0)
            normal = _poll("DriftRateNormal", fetch, lambda o: _coherent(o).get("status") == "True")
            assert _coherent(normal)["reason"] == "DriftRateNormal"
            assert normal["status"]["cache"]["driftRate"] <= THRESHOLD

            traffic.close()
            frontend.stop()
            # briefly idle (True held, reason NoTraffic: no shadow hits), then nobody answers
            gone = _poll(
                "ProbeFailed", fetch, lambda o: _coherent(o).get("reason") == "ProbeFailed"
            )
            assert _coherent(gone)["status"] == "Unknown"
            assert "cache" in _coherent(gone)["message"]
        finally:
            traffic.close()
            knob.close()
    assert running.error is None, f"the operator died: {running.error!r}"
    assert traffic.failures == [], traffic.failures[:3]
    events = ok.get(cluster, namespace, "events", "--field-selector=involvedObject.name=tiny")
    reasons = [e["reason"] for e in events["items"]]
    for reason in ("DriftRateHigh", "DriftRateNormal", "ProbeFailed"):
        assert reason in reasons, reasons
    warnings = {e["reason"] for e in events["items"] if e["type"] == "Warning"}
    assert "DriftRateHigh" in warnings
