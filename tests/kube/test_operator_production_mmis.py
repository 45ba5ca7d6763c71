"""Production behaviour of the operator against the real control plane: model storage, rollouts
on full GPU nodes, the disruption budget, status a person can act on, and the safety rules.

kwok runs the pods (no kubelet): the real scheduler produces ``Unschedulable``; container
states a kubelet would report (ImagePullBackOff, CrashLoopBackOff, CreateContainerConfigError)
are written into a running pod's status here, as kwok lets any client do, and the operator has
to read them back from the API server. The namespace enforces Pod Security ``restricted``.
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import operator_kit as ok
import pytest
from kubecluster import Cluster

from mmis_operator.main import OperatorThread

pytestmark = pytest.mark.controlplane

SAMPLE: dict[str, Any] = {
    "apiVersion": "mmis.dev/v1alpha1",
    "kind": "MMInferenceService",
    "metadata": {"name": "vlm"},
    "spec": {
        "model": {"id": "llava-hf/llava-1.5-7b-hf"},
        "replicas": 1,
        "resources": {"gpus": 1, "memory": "8Gi", "cpu": "1", "frontendCpu": "500m"},
        "cache": {"size": "1Gi"},
        "probes": {"startupTimeoutSeconds": 600, "drainSeconds": 0},
    },
}


def _sample(**spec: Any) -> dict[str, Any]:
    obj = copy.deepcopy(SAMPLE)
    obj["spec"].update(spec)
    return obj


def _pods(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    selector = f"mmis.dev/service={name}"
    items: list[dict[str, Any]] = ok.get(cluster, namespace, "pods", "-l", selector)["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def _set_container_state(
    cluster: Cluster, namespace: str, pod: dict[str, Any], container: str, state: dict[str, Any]
) -> None:
    """Write what a kubelet would report for ``container`` (kwok leaves it be)."""
    statuses = copy.deepcopy(pod["status"]["containerStatuses"])
    for cs in statuses:
        if cs["name"] == container:
            cs.update(state, ready=False, started=False)
    conditions = [
        {**c, "status": "False"} if c["type"] in ("Ready", "ContainersReady") else c
        for c in pod["status"]["conditions"]
    ]
    patch = {"status": {"containerStatuses": statuses, "conditions": conditions}}
    cluster.kubectl(
        "patch", "-n", namespace, "pod", pod["metadata"]["name"], "--subresource=status",
        "--type=merge", "-p", json.dumps(patch),
    )  # fmt: skip


def _wait_reason(cluster: Cluster, namespace: str, name: str, reason: str) -> dict[str, Any]:
    ok.wait(
        cluster, namespace, f"mmis/{name}",
        f"--for=jsonpath={{.status.conditions[?(@.type==\"Degraded\")].reason}}={reason}",
    )  # fmt: skip
    return ok.get(cluster, namespace, f"mmis/{name}")


# -- item 6: status a person can act on ------------------------------------------------------


def test_unschedulable_shows_the_schedulers_message(
    cluster: Cluster, namespace: str, operator: OperatorThread
) -> None:
    big = _sample(resources={**SAMPLE["spec"]["resources"], "gpus": 9})  # nodes have 8
    ok.apply(cluster, namespace, big)
    obj = _wait_reason(cluster, namespace, "vlm", "Unschedulable")
    degraded = ok.condition(obj, "Degraded")
    assert degraded["status"] == "True"
    assert "Insufficient nvidia.com/gpu" in degraded["message"]
    assert ok.condition(obj, "Progressing")["reason"] == "Unschedulable"
    assert ok.condition(obj, "Ready")["reason"] == "Unschedulable"  # `kubectl get mmis` shows it
    events = ok.get(cluster, namespace, "events", "--field-selector=involvedObject.name=vlm")
    assert any(e["reason"] == "Unschedulable" and e["type"] == "Warning" for e in events["items"])
    ok.apply(cluster, namespace, SAMPLE)  # the fix
    ok.wait(cluster, namespace, "mmis/vlm", "--for=condition=Ready")
    ok.wait(cluster, namespace, "mmis/vlm", "--for=condition=Degraded=False")


@pytest.mark.parametrize(
    ("container", "state", "reason", "words"),
    [
        ("engine",
         {"state": {"waiting": {"reason": "ImagePullBackOff",
                                "message": 'Back-off pulling image "ghcr.io/x:nope"'}}},
         "ImagePullBackOff", 'pulling image "ghcr.io/x:nope"'),
        ("frontend",
         {"state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
          "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137}},
          "restartCount": 3},
         "CrashLoopBackOff", "last exit OOMKilled (exit code 137, 3 restarts)"),
        ("frontend",
         {"state": {"waiting": {"reason": "CreateContainerConfigError",
                                "message": 'secret "api-keys" not found'}}},
         "CreateContainerConfigError", 'secret "api-keys" not found'),
    ],
    ids=["image-pull", "crash-loop", "missing-secret"],
)  # fmt: skip
def test_container_states_surface_with_the_real_reason(
    cluster: Cluster,
    namespace: str,
    operator: OperatorThread,
    container: str,
    state: dict[str, Any],
    reason: str,
    words: str,
) -> None:
    ok.apply(cluster, namespace, SAMPLE)
    ok.wait(cluster, namespace, "mmis/vlm", "--for=condition=Ready")
    (pod,) = _pods(cluster, namespace, "vlm")
    _set_container_state(cluster, namespace, pod, container, state)
    obj = _wait_reason(cluster, namespace, "vlm", reason)
    degraded = ok.condition(obj, "Degraded")
    assert degraded["status"] == "True"
    assert f"pod {pod['metadata']['name']}, container {container}" in degraded["message"]
    assert words in degraded["message"]
    assert ok.condition(obj, "Ready")["status"] == "False"


# -- item 4: model storage -------------------------------------------------------------------


def _manual_volume(cluster: Cluster, name: str, size: str) -> None:
    """A PersistentVolume the real PV controller can bind (the test cluster has no
    provisioner); cluster-scoped, so each test names its own."""
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name},
        "spec": {
            "capacity": {"storage": size},
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "manual",
            "persistentVolumeReclaimPolicy": "Delete",
            "hostPath": {"path": f"/tmp/{name}"},  # never mounted: kwok runs no containers
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pv))


def test_model_on_a_claim_with_a_token_secret(
    cluster: Cluster, namespace: str, operator: OperatorThread
) -> None:
    _manual_volume(cluster, f"pv-{namespace}", "100Gi")
    cluster.kubectl(
        "create", "secret", "generic", "hf", "-n", namespace, "--from-literal=token=hf_x"
    )
    obj = _sample()
    obj["spec"]["model"] = {
        "id": "llava-hf/llava-1.5-7b-hf",
        "storage": {"type": "PersistentVolumeClaim", "size": "80Gi",
                    "storageClassName": "manual"},
        "tokenSecretRef": {"name": "hf"},
    }  # fmt: skip
    ok.apply(cluster, namespace, obj)
    ok.wait(cluster, namespace, "mmis/vlm", "--for=condition=Ready")  # admitted: PSA restricted
    owner = ok.get(cluster, namespace, "mmis/vlm")
    claim = ok.get(cluster, namespace, "pvc/vlm-model-cache")
    assert claim["spec"]["resources"]["requests"]["storage"] == "80Gi"
    assert claim["status"]["phase"] == "Bound"
    assert claim["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
    pod_spec = ok.get(cluster, namespace, "deployment/vlm")["spec"]["template"]["spec"]
    (cache,) = [v for v in pod_spec["volumes"] if v["name"] == "model-cache"]
    assert cache == {
        "name": "model-cache",
        "persistentVolumeClaim": {"claimName": "vlm-model-cache"},
    }
    (download,) = pod_spec["initContainers"]
    (token,) = [e for e in download["env"] if e["name"] == "HF_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    assert pod_spec["automountServiceAccountToken"] is False
    (pod,) = _pods(cluster, namespace, "vlm")
    assert "kube-api-access" not in json.dumps(pod["spec"]["volumes"])  # no token mounted


def test_empty_dir_cache_is_sized_and_requested(
    cluster: Cluster, namespace: str, operator: OperatorThread
) -> None:
    obj = _sample()
    obj["spec"]["model"] = {**SAMPLE["spec"]["model"], "storage": {"size": "30Gi"}}
    ok.apply(cluster, namespace, obj)
    ok.wait(cluster, namespace, "mmis/vlm", "--for=condition=Ready")
    (pod,) = _pods(cluster, namespace, "vlm")
    (cache,) = [v for v in pod["spec"]["volumes"] if v["name"] == "model-cache"]
    assert cache["emptyDir"] == {"sizeLimit": "30Gi"}
    engine = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
    assert engine["resources"]["requests"]["ephemeral-storage"] == "30Gi"


def test_pod_template_volume_replaces_the_model_cache(
    cluster: Cluster, namespace: str, operator: OperatorThread
) -> None:
    """Before: emptyDir and persistentVolumeClaim merged into one volume, which the API server
    refused. Now the podTemplate's volume of the same name replaces ours."""
    _manual_volume(cluster, f"pv-{namespace}", "60Gi")
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "shared-models"},
        "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "manual",
                 "resources": {"requests": {"storage": "60Gi"}}},
    }  # fmt: skip
    ok.apply(cluster, namespace, claim)
    volume = {"name": "model-cache", "persistentVolumeClaim": {"claimName": "shared-models"}}
    ok.apply(cluster, namespace, _sample(podTemplate={"spec": {"volumes": [volume]}}))
    ok.wait(cluster, namespace, "mmis/vlm", "--for=condition=Ready")
    pod_spec = ok.get(cluster, namespace, "deployment/vlm")["spec"]["template"]["spec"]
    (cache,) = [v for v in pod_spec["volumes"] if v["name"] == "model-cache"]
    assert cache == volume


# -- item 5: rollouts and disruption ---------------------------------------------------------


def test_rollout_completes_on_full_gpu_nodes(
    cluster: Cluster, namespace: str, operator: OperatorThread
) -> None:
    """Every GPU of both nodes taken: with surge 1 the new pod would wait forever."""
    full = _sample(replicas=len(cluster.nodes))
    full["spec"]["resources"] = {**SAMPLE["spec"]["resources"], "gpus": 8}
    # the old pods' grace period (drainSeconds + 35 s by default, kwok honours it) is what the
    # rollout waits for at each step; 1 s keeps the same order of events in a few seconds
    full["spec"]["podTemplate"] = {"spec": {"terminationGracePeriodSeconds": 1}}
    ok.apply(cluster, namespace, full)
    ok.wait(cluster, namespace, "mmis/vlm", "--for=condition=Ready")
    dep = ok.get(cluster, namespace, "deployment/vlm")
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    changed = copy.deepcopy(full)
    changed["spec"]["cache"] = {"size": "2Gi"}
    ok.apply(cluster, namespace, changed)
    ok.wait(cluster, namespace, "mmis/vlm", "--for=jsonpath={.status.observedGeneration}=2")
    # two steps, each an old pod's grace period and a new pod's start
    ok.wait(cluster, namespace, "mmis/vlm", "--for=condition=Progressing=False", timeout_s=420)
    ok.wait(cluster, namespace, "mmis/vlm", "--for=condition=Ready")
    for pod in _pods(cluster, namespace, "vlm"):
        args = next(c for c in pod["spec"]["containers"] if c["name"] == "frontend")["args"]
        assert args[args.index("--mm-cache-gb") + 1] == "2"


def test_disruption_budget_follows_the_spec(
    cluster: Cluster, namespace: str, operator: OperatorThread
) -> None:
    ok.apply(cluster, namespace, _sample(replicas=2))
    ok.wait(cluster, namespace, "mmis/vlm", "--for=condition=Ready")
    owner = ok.get(cluster, namespace, "mmis/vlm")
    pdb = ok.get(cluster, namespace, "pdb/vlm")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
    ok.wait(cluster, namespace, "pdb/vlm", "--for=jsonpath={.status.currentHealthy}=2")
    assert ok.get(cluster, namespace, "pdb/vlm")["status"]["disruptionsAllowed"] == 1
    ok.apply(cluster, namespace, _sample(replicas=2, disruption={"maxUnavailable": "50%"}))
    ok.wait(cluster, namespace, "pdb/vlm", "--for=jsonpath={.spec.maxUnavailable}=50%")
    ok.apply(cluster, namespace, _sample(replicas=2, disruption={"enabled": False}))
    ok.wait(cluster, namespace, "pdb/vlm", "--for=delete")


# -- item 9: safety ----------------------------------------------------------------------------


def test_fault_injection_is_refused_without_the_flag(
    cluster: Cluster, namespace: str, operator: OperatorThread
) -> None:
    ok.apply(cluster, namespace, _sample(engine={"faultEvictRate": 0.2}))
    obj = _wait_reason(cluster, namespace, "vlm", "FieldRefused")
    assert "spec.engine.faultEvictRate" in ok.condition(obj, "Degraded")["message"]
    gone = cluster.kubectl("get", "-n", namespace, "deployment/vlm", check=False)
    assert "NotFound" in gone.stderr  # no pod ever ran with it
    events = ok.get(cluster, namespace, "events", "--field-selector=involvedObject.name=vlm")
    assert any(e["reason"] == "FieldRefused" for e in events["items"])


def test_fault_injection_runs_with_the_flag(cluster: Cluster, crd: None, namespace: str) -> None:
    with OperatorThread(cluster.kubeconfig, ok.options(namespace, allow_fault_injection=True)):
        ok.apply(cluster, namespace, _sample(engine={"faultEvictRate": 0.2}))
        ok.wait(cluster, namespace, "mmis/vlm", "--for=condition=Ready")
    dep = ok.get(cluster, namespace, "deployment/vlm")
    engine = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"]
    assert "--fault-evict-rate" in engine[0]["args"]


def test_pod_template_typo_is_a_condition_naming_the_field(
    cluster: Cluster, namespace: str, operator: OperatorThread
) -> None:
    typo = {"spec": {"containers": [{"name": "engine", "imagePullPolicyy": "Always"}]}}
    ok.apply(cluster, namespace, _sample(podTemplate=typo))
    obj = _wait_reason(cluster, namespace, "vlm", "InvalidPodTemplate")
    assert "imagePullPolicyy" in ok.condition(obj, "Degraded")["message"]
    assert "NotFound" in cluster.kubectl("get", "-n", namespace, "deploy/vlm", check=False).stderr


def test_ingress_routes_only_the_api_and_health(
    cluster: Cluster, namespace: str, operator: OperatorThread
) -> None:
    ok.apply(cluster, namespace, _sample(ingress={"enabled": True, "host": "vlm.example.com"}))
    ok.wait(cluster, namespace, "mmis/vlm", "--for=condition=Ready")
    ingress = ok.get(cluster, namespace, "ingress/vlm")
    paths = [p["path"] for p in ingress["spec"]["rules"][0]["http"]["paths"]]
    assert paths == ["/v1", "/health"]
    ports = ok.get(cluster, namespace, "service/vlm")["spec"]["ports"]
    assert [p["name"] for p in ports] == ["http"]  # never the ops port (/metrics)
    (pod,) = _pods(cluster, namespace, "vlm")
    front = next(c for c in pod["spec"]["containers"] if c["name"] == "frontend")
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in front["env"]


def test_delete_needs_no_operator(cluster: Cluster, crd: None, namespace: str) -> None:
    """The uninstall path: with the operator gone, deleting a resource still completes and
    garbage collection removes its children. A finalizer an older operator left is removed
    by the operator on its first look."""
    old = copy.deepcopy(SAMPLE)
    old["metadata"]["finalizers"] = ["mmis.dev/finalizer"]
    ok.apply(cluster, namespace, old)
    with OperatorThread(cluster.kubeconfig, ok.options(namespace)):
        ok.wait(cluster, namespace, "mmis/vlm", "--for=condition=Ready")
        deadline = time.monotonic() + 60
        while ok.get(cluster, namespace, "mmis/vlm")["metadata"].get("finalizers"):
            assert time.monotonic() < deadline, "the old finalizer was not removed"
            time.sleep(0.5)  # polling the API server; not a synchronisation
    # the operator is stopped now
    started = time.monotonic()
    cluster.kubectl("delete", "-n", namespace, "mmis/vlm", "--timeout=60s", timeout=90)
    assert time.monotonic() - started < 60
    for kind in ("deployment", "service", "pdb"):
        ok.wait(cluster, namespace, f"{kind}/vlm", "--for=delete", timeout_s=120)


def test_test_namespaces_enforce_pod_security_restricted(cluster: Cluster, namespace: str) -> None:
    """So every pod the other tests get admitted (the operator's, the inference pods) passed
    the ``restricted`` profile for real."""
    root_pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "root"},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }
    proc = cluster.kubectl(
        "create", "--dry-run=server", "-n", namespace, "-f", "-",
        input=json.dumps(root_pod), check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert 'violates PodSecurity "restricted:latest"' in proc.stderr
