"""The operator against the real control plane (kwok runs the pods; their IPs are fake).

The operator runs in-process (``OperatorThread``: kopf's runner in a thread with a stop flag),
watching only the test's namespace. Waiting is done with ``kubectl wait`` (watch-based).
"""

from __future__ import annotations

import copy
import json
import os
import re
import socket
import subprocess
import sys
import urllib.request
from typing import Any

import operator_kit as ok
import pytest
from kubecluster import Cluster

from mmis_operator.main import OperatorThread

pytestmark = pytest.mark.controlplane

SAMPLE: dict[str, Any] = {
    "apiVersion": "mmis.dev/v1alpha1",
    "kind": "MMInferenceService",
    "metadata": {"name": "llava"},
    "spec": {
        "model": {"id": "llava-hf/llava-1.5-7b-hf"},
        "replicas": 1,
        "resources": {"gpus": 2, "memory": "8Gi", "cpu": "1", "frontendCpu": "500m"},
        "cache": {"type": "shm", "size": "2Gi", "shmSize": "3Gi"},
        "probes": {"startupTimeoutSeconds": 600, "drainSeconds": 5},
    },
}


def _apply_ready(cluster: Cluster, namespace: str, obj: dict[str, Any] = SAMPLE) -> None:
    """Apply ``obj`` and wait until the operator reports it Ready."""
    ok.apply(cluster, namespace, obj)
    ok.wait(cluster, namespace, f"mmis/{obj['metadata']['name']}", "--for=condition=Ready")


def _events(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    items = ok.get(cluster, namespace, "events", f"--field-selector=involvedObject.name={name}")
    return [e for e in items["items"] if e["involvedObject"]["kind"] == "MMInferenceService"]


def test_resource_becomes_a_ready_deployment_and_service(
    cluster: Cluster, namespace: str, operator: OperatorThread
) -> None:
    _apply_ready(cluster, namespace)
    dep = ok.get(cluster, namespace, "deployment/llava")
    pod_spec = dep["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod_spec["containers"]}
    assert set(containers) == {"frontend", "engine"}
    assert containers["engine"]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    (shm,) = [v for v in pod_spec["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "3584Mi"}
    assert containers["frontend"]["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert containers["frontend"]["startupProbe"]["failureThreshold"] == 60
    svc = ok.get(cluster, namespace, "service/llava")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    owner = ok.get(cluster, namespace, "mmis/llava")
    for child in (dep, svc):
        assert child["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
    pods = ok.get(cluster, namespace, "pods", "-l", owner["status"]["selector"])["items"]
    assert [p["status"]["phase"] for p in pods] == ["Running"]
    status = owner["status"]
    assert status["observedGeneration"] == owner["metadata"]["generation"]
    assert status["readyReplicas"] == 1
    assert status["endpoint"] == f"http://llava.{namespace}.svc:8000/v1"
    assert ok.condition(owner, "Degraded")["status"] == "False"
    assert not owner["metadata"].get("finalizers")  # deletion never waits for the operator
    assert any(k.startswith("mmis.dev/") for k in owner["metadata"]["annotations"])
    reasons = {e["reason"] for e in _events(cluster, namespace, "llava")}
    assert "AllReplicasReady" in reasons


def test_spec_change_rolls_out_and_observed_generation_follows(
    cluster: Cluster, namespace: str, operator: OperatorThread
) -> None:
    _apply_ready(cluster, namespace)
    before = ok.get(cluster, namespace, "deployment/llava")
    changed = copy.deepcopy(SAMPLE)
    changed["spec"]["cache"]["size"] = "3Gi"
    ok.apply(cluster, namespace, changed)
    generation = ok.get(cluster, namespace, "mmis/llava")["metadata"]["generation"]
    assert generation == 2
    ok.wait(cluster, namespace, "mmis/llava", "--for=jsonpath={.status.observedGeneration}=2")
    ok.wait(cluster, namespace, "mmis/llava", "--for=condition=Progressing=False")
    ok.wait(cluster, namespace, "mmis/llava", "--for=condition=Ready")
    after = ok.get(cluster, namespace, "deployment/llava")
    assert after["metadata"]["generation"] > before["metadata"]["generation"]
    args = {c["name"]: c["args"] for c in after["spec"]["template"]["spec"]["containers"]}
    assert args["frontend"][args["frontend"].index("--mm-cache-gb") + 1] == "3"


def _watch_statuses(cluster: Cluster, namespace: str, name: str) -> subprocess.Popen[str]:
    """``kubectl get -w -o json``: every version of the resource the API server stores."""
    cmd = [str(cluster.bin("kubectl")), "get", "-n", namespace, f"mmis/{name}", "-w", "-o", "json"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=cluster.env)


def _versions(watch: subprocess.Popen[str]) -> list[dict[str, Any]]:
    watch.terminate()
    text, _ = watch.communicate(timeout=30)
    decoder, found, at = json.JSONDecoder(), [], 0
    while (at := text.find("{", at)) >= 0:
        try:
            obj, at = decoder.raw_decode(text, at)
        except ValueError:  # the last object, cut short by the terminate
            break
        found.append(obj)
    return found


def test_scale_up_and_down_keeps_ready_while_a_pod_serves(
    cluster: Cluster, namespace: str, operator: OperatorThread
) -> None:
    """Ready means serving: `kubectl scale` up (to 3, then past the nodes' GPUs, so one pod
    stays Pending) and down never turns it False in any stored version; Progressing carries
    the scale, and only the real problem (no GPU for the 9th pod) is a Warning."""
    _apply_ready(cluster, namespace)
    watch = _watch_statuses(cluster, namespace, "llava")
    try:
        cluster.kubectl("scale", "-n", namespace, "mmis/llava", "--replicas=3")
        ok.wait(cluster, namespace, "mmis/llava", "--for=jsonpath={.status.readyReplicas}=3")
        ok.wait(cluster, namespace, "mmis/llava", "--for=condition=Progressing=False")
        scale = ok.get(cluster, namespace, "mmis/llava", "--subresource=scale")
        assert (scale["spec"]["replicas"], scale["status"]["replicas"]) == (3, 3)
        assert "mmis.dev/service=llava" in scale["status"]["selector"]
        # 9 pods of 2 GPUs on 2 nodes of 8: the 9th cannot be scheduled
        cluster.kubectl("scale", "-n", namespace, "mmis/llava", "--replicas=9")
        ok.wait(cluster, namespace, "mmis/llava", "--for=condition=Degraded")
        stuck = ok.get(cluster, namespace, "mmis/llava")
        assert ok.condition(stuck, "Progressing")["reason"] == "Unschedulable"
        cluster.kubectl("scale", "-n", namespace, "mmis/llava", "--replicas=1")
        ok.wait(cluster, namespace, "mmis/llava", "--for=jsonpath={.status.replicas}=1")
        ok.wait(cluster, namespace, "mmis/llava", "--for=condition=Progressing=False")
        ok.wait(cluster, namespace, "mmis/llava", "--for=condition=Degraded=False")
    finally:
        versions = _versions(watch)
    readies = [ok.find_condition(v, "Ready") for v in versions]
    lost = [
        (v.get("kind"), v.get("metadata", {}).get("resourceVersion"), c)
        for v, c in zip(versions, readies, strict=True)
        if not (c and c["status"] == "True")
    ]  # each version without Ready=True: its kind (a Status is a watch error), its version
    assert len(versions) > 3 and not lost, (len(versions), lost)
    progressing = [c for v in versions if (c := ok.find_condition(v, "Progressing"))]
    assert any(c["status"] == "True" for c in progressing), progressing  # the scale shows here
    final = ok.get(cluster, namespace, "mmis/llava")  # the watch's tail may be cut short
    assert ok.condition(final, "Progressing")["reason"] == "RolloutComplete"
    assert ok.condition(final, "Ready")["status"] == "True"
    # no Warning but the real problem (GPUs still held by an earlier test's pods may make it
    # show on the way to 3 too): never a Ready lost
    warned = [(e["reason"], e["message"]) for e in _events(cluster, namespace, "llava")
              if e["type"] == "Warning"]  # fmt: skip
    assert {reason for reason, _ in warned} <= {"Unschedulable"}, warned


def test_deletion_removes_children(
    cluster: Cluster, namespace: str, operator: OperatorThread
) -> None:
    _apply_ready(cluster, namespace)
    cluster.kubectl("delete", "-n", namespace, "mmis/llava", "--wait=false")
    ok.wait(cluster, namespace, "mmis/llava", "--for=delete")
    # garbage collection (owner references) removes the children; no finalizer held the owner
    for child in ("deployment/llava", "service/llava", "pdb/llava"):
        ok.wait(cluster, namespace, child, "--for=delete")


def test_invalid_spec_is_reported_not_retried_and_a_fix_recovers(
    cluster: Cluster, namespace: str, operator: OperatorThread
) -> None:
    bad = copy.deepcopy(SAMPLE)
    bad["spec"]["resources"]["memory"] = "1Gi"  # the 2Gi engine cache cannot fit: no CEL rule
    ok.apply(cluster, namespace, bad)
    ok.wait(cluster, namespace, "mmis/llava", "--for=condition=Degraded")
    obj = ok.get(cluster, namespace, "mmis/llava")
    degraded = ok.condition(obj, "Degraded")
    assert degraded["reason"] == "InvalidSpec"
    assert "raise resources.memory" in degraded["message"]
    assert (
        "NotFound"
        in cluster.kubectl("get", "-n", namespace, "deployment/llava", check=False).stderr
    )
    warnings = [e for e in _events(cluster, namespace, "llava") if e["type"] == "Warning"]
    assert any(e["reason"] == "InvalidSpec" for e in warnings)
    _apply_ready(cluster, namespace)  # the fix
    ok.wait(cluster, namespace, "mmis/llava", "--for=condition=Degraded=False")
    assert operator.error is None


def test_foreign_conditions_survive_reconciles(
    cluster: Cluster, namespace: str, operator: OperatorThread
) -> None:
    _apply_ready(cluster, namespace)
    # a type nobody in mmis writes (the operator's own drift probe now owns CacheCoherent),
    # written as a policy controller writes it: read, append, replace with the read's
    # resourceVersion, and on a 409 (the operator wrote status in between) read again
    for _ in range(20):
        obj = ok.get(cluster, namespace, "mmis/llava")
        obj["status"]["conditions"].append(
            {"type": "example.com/PolicyChecked", "status": "True", "reason": "Approved",
             "message": "checked by a policy controller",
             "lastTransitionTime": "2026-01-01T00:00:00Z"}
        )  # fmt: skip
        put = cluster.kubectl(
            "replace", "--subresource=status", "-n", namespace, "-f", "-",
            input=json.dumps(obj), check=False,
        )  # fmt: skip
        if put.returncode == 0:
            break
        assert "Conflict" in put.stderr, put.stderr
    else:
        raise AssertionError("the status replace met a conflict 20 times in a row")
    cluster.kubectl("scale", "-n", namespace, "mmis/llava", "--replicas=2")
    ok.wait(cluster, namespace, "mmis/llava", "--for=jsonpath={.status.readyReplicas}=2")
    after = ok.get(cluster, namespace, "mmis/llava")
    assert ok.condition(after, "example.com/PolicyChecked")["reason"] == "Approved"


def test_deleted_deployment_is_recreated(
    cluster: Cluster, namespace: str, operator: OperatorThread
) -> None:
    _apply_ready(cluster, namespace)
    uid = ok.get(cluster, namespace, "deployment/llava")["metadata"]["uid"]
    cluster.kubectl("delete", "-n", namespace, "deployment/llava", "--wait=true")
    ok.wait(cluster, namespace, "deployment/llava", "--for=create")
    assert ok.get(cluster, namespace, "deployment/llava")["metadata"]["uid"] != uid
    ok.wait(cluster, namespace, "mmis/llava", "--for=condition=Ready")


def test_apiserver_restart_does_not_wedge_the_operator(
    cluster: Cluster, namespace: str, operator: OperatorThread
) -> None:
    """Also the control plane's own restart (it was test_controlplane's test): a new
    kube-apiserver process, the old one gone, the state kept (etcd) and this client and the
    operator's connected again."""
    _apply_ready(cluster, namespace)
    old_pid = cluster.pids()["kube-apiserver"]
    cluster.restart_apiserver()
    assert cluster.pids()["kube-apiserver"] != old_pid
    with pytest.raises(ProcessLookupError):
        os.kill(old_pid, 0)
    second = copy.deepcopy(SAMPLE)
    second["metadata"]["name"] = "after-restart"
    _apply_ready(cluster, namespace, second)
    cluster.kubectl("scale", "-n", namespace, "mmis/llava", "--replicas=2")
    ok.wait(cluster, namespace, "mmis/llava", "--for=jsonpath={.status.readyReplicas}=2")
    assert operator.error is None


def test_mmis_operator_command_runs_and_stops_cleanly(
    cluster: Cluster, crd: None, namespace: str
) -> None:
    """The real command; at INFO its log says what changed (the children it created, the
    condition transitions), not each handler's success or each liveness GET."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    cmd = [sys.executable, "-m", "mmis", "operator", f"--kubeconfig={cluster.kubeconfig}",
           f"--namespace={namespace}",
           f"--liveness-endpoint=http://127.0.0.1:{port}/healthz"]  # fmt: skip
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        try:
            _apply_ready(cluster, namespace)
            for _ in range(3):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
                    assert r.status == 200
        finally:
            proc.terminate()
            out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-4000:]
    assert f"created Deployment {namespace}/llava" in out, out[-4000:]
    # "unset -> True" when the first status write already saw the pod ready (kwok is quick)
    ready = re.compile(rf"{namespace}/llava: Ready (False|unset) -> True \(AllReplicasReady\)")
    assert ready.search(out), out[-4000:]
    assert "Handler '" not in out and "is processed" not in out, out[-4000:]
    assert "GET /healthz" not in out, out[-4000:]
