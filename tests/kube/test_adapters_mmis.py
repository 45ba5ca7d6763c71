"""``spec.adapters`` against the real control plane: a change reaches a running pod without a
restart (issue 47 Build 4's acceptance, the operator's point).

kwok runs the resource's pod with a fake IP, so the resource carries the test-only
``mmis.dev/stats-endpoints`` annotation (honoured because this operator is started with
``allow_stats_endpoint_override``) pointing at a real ``mmis serve`` on the tiny model with
``--enable-lora``, its ops port, and the internal token the operator derives from its
``internal_key`` (what the Secret ``NAME-internal`` would hand P0 in a real pod). The probe
timer is slow (600 s), so only the ``spec.adapters`` field handler and the push to a pod that
turns Ready can sync within the test's deadlines. Every wait polls an observable state with a
deadline.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import operator_kit as ok
import pytest
from kubecluster import Cluster
from kubecluster.process import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lora_adapters import LM, make_adapter
from procs import Proc, running

from mmis.tiny_models.tiny_model import tiny_model_dir
from mmis_operator.adapters import internal_token
from mmis_operator.main import OperatorThread
from mmis_operator.probe import OVERRIDE_ANNOTATION

pytestmark = [pytest.mark.controlplane, pytest.mark.model, pytest.mark.slow]

KEY = "test-internal-key"
SYNC_S = 20.0  # a spec.adapters change reaches the pod within this (the timer is 600 s)
PUSH_S = 10.0  # a pod that turns Ready gets spec.adapters within this (the timer is 600 s)


def _until(what: str, check: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.3)  # polling an observable state, not a synchronisation
    pytest.fail(f"timed out after {timeout:g} s waiting for {what}")


@pytest.mark.timeout(300)
def test_an_adapter_reaches_the_running_pod_without_a_restart(
    cluster: Cluster, crd: None, namespace: str, tmp_path: Path
) -> None:
    ops = free_port()
    resource = {
        "apiVersion": "mmis.dev/v1alpha1",
        "kind": "MMInferenceService",
        "metadata": {
            "name": "tiny",
            "annotations": {OVERRIDE_ANNOTATION: f"http://127.0.0.1:{ops}"},
        },
        "spec": {
            "model": {"id": "llava-hf/llava-1.5-7b-hf"},
            "replicas": 1,
            "resources": {"gpus": 1, "memory": "8Gi"},
            "adapters": [],
        },
    }
    options = ok.options(
        namespace, probe_seconds=600.0, allow_stats_endpoint_override=True, internal_key=KEY
    )

    def patch(items: list[dict[str, str]]) -> None:
        body = json.dumps({"spec": {"adapters": items}})
        cluster.kubectl("patch", "-n", namespace, "mmis/tiny", "--type=merge", "-p", body)

    def holds(names: list[str]) -> dict[str, Any] | None:
        """The one replica's status.adapters entry when it holds ``names`` and no error."""
        found = ok.get(cluster, namespace, "mmis/tiny").get("status", {}).get("adapters") or []
        if len(found) == 1 and found[0]["adapters"] == names and "error" not in found[0]:
            return dict(found[0])
        return None

    def template() -> tuple[int, str]:
        dep = ok.get(cluster, namespace, "deploy/tiny")
        spec = json.dumps(dep["spec"]["template"], sort_keys=True)
        return int(dep["metadata"]["generation"]), spec

    # the resource first (its uid gives the token), then the server, the adapter and the
    # operator while the server starts
    ok.apply(cluster, namespace, resource)
    uid = ok.get(cluster, namespace, "mmis/tiny")["metadata"]["uid"]
    env = {"OMP_NUM_THREADS": "1"}
    token = internal_token(KEY, namespace, "tiny", uid)
    env["MMIS_FRONTEND_INTERNAL_TOKEN"] = token
    args = ["serve", "--port", "0", "--model", str(tiny_model_dir())]
    args += ["--served-model-name", "tiny", "--enable-lora", "--ops-port", str(ops)]
    serve = Proc("serve-adapters", args, tmp_path, env, announces=True)
    try:
        adapter = make_adapter(tiny_model_dir(), tmp_path / "lm", LM, rank=8, alpha=16, seed=1)
        with OperatorThread(cluster.kubeconfig, options):
            serve.wait_http("/ready", 180)
            ok.wait(cluster, namespace, "mmis/tiny", "--for=condition=Ready")
            before, pid = template(), serve.popen.pid
            http = httpx.Client(base_url=serve.root_url, timeout=60)

            def models() -> set[str]:
                return {m["id"] for m in http.get("/v1/models").json()["data"]}

            patch([{"name": "lm", "source": str(adapter)}])
            _until("the pod to list lm", lambda: "lm" in models(), SYNC_S)
            chat = {
                "model": "lm",
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 2,
            }
            answer = http.post("/v1/chat/completions", json=chat)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == "lm"
            entry = _until("status.adapters to name lm", lambda: holds(["lm"]), SYNC_S)
            assert entry["pod"].startswith("tiny-")

            # a restarted pod: a new pod (the server, its lm gone as in a fresh process) that
            # turns Ready gets lm at once, long before the probe tick
            unload = httpx.post(
                f"http://127.0.0.1:{ops}/internal/unload_lora_adapter",
                json={"lora_name": "lm"},
                headers={"Authorization": f"Bearer {token}"},
            )
            assert unload.status_code == 200, unload.text
            assert "lm" not in models()
            cluster.kubectl("delete", "pod", "-n", namespace, entry["pod"], "--wait=false")
            _until("the new pod to list lm", lambda: "lm" in models(), PUSH_S)

            def new_pod_holds_lm() -> dict[str, Any] | None:
                found = holds(["lm"])
                return found if found and found["pod"] != entry["pod"] else None

            _until("status.adapters of the new pod", new_pod_holds_lm, SYNC_S)

            patch([])
            _until("the pod to drop lm", lambda: "lm" not in models(), SYNC_S)
            _until("status.adapters to be empty", lambda: holds([]), SYNC_S)
            assert template() == before  # no new generation, the same pod template
            assert serve.popen.pid == pid and running(pid) and serve.popen.poll() is None
            http.close()
    finally:
        serve.stop()
