"""``spec.encoder`` against the real control plane: the operator (a real ``OperatorThread``
with ``--encoders``) creates the encoder objects, owned by the resource (its uid, controller:
garbage collection deletes them with it; not waited for here, ~35 s on this control plane),
wires the front ends; removing ``spec.encoder`` deletes them and the PD pods are as without
it. The encoder pod is admitted under Pod Security ``restricted`` as built.

An operator installed without ``encoder.enabled`` is covered against the in-memory API
(tests/operator/test_encoder.py); the CRD's rules in tests/kube/test_crd_encoder_mmis.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import operator_kit as ok
import pytest
from kubecluster import Cluster

from mmis_operator import builders, routing, status
from mmis_operator import kube as r
from mmis_operator.main import OperatorThread
from mmis_operator.spec import parse_spec

pytestmark = pytest.mark.controlplane

NAME = "epd"
ENCODER = r.encoder_name(NAME)
TYPES = ("deployments.apps", "services", "networkpolicies.networking.k8s.io")
SPEC: dict[str, Any] = {
    "model": {"id": "llava-hf/llava-1.5-7b-hf"},
    "resources": {"gpus": 0, "memory": "8Gi", "cpu": "1", "frontendCpu": "500m"},
    "cache": {"size": "1Gi"},
    "encoder": {"resources": {"cpu": "500m", "memory": "2Gi"}},
}


@pytest.fixture
def encoders_operator(cluster: Cluster, crd: None, namespace: str) -> Iterator[OperatorThread]:
    options = ok.options(namespace, encoders=True)
    with OperatorThread(cluster.kubeconfig, options) as running:
        yield running
    assert running.error is None, f"the operator died: {running.error!r}"


def _resource(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": r.API_VERSION, "kind": r.KIND, "metadata": {"name": NAME}, "spec": spec}


def _reconciled(cluster: Cluster, namespace: str) -> None:
    generation = ok.get(cluster, namespace, f"mmis/{NAME}")["metadata"]["generation"]
    jsonpath = f"--for=jsonpath={{.status.observedGeneration}}={generation}"
    ok.wait(cluster, namespace, f"mmis/{NAME}", jsonpath)


def _existing(cluster: Cluster, namespace: str) -> list[str]:
    found = []
    for kind in TYPES:
        proc = cluster.kubectl(
            "get", "-n", namespace, f"{kind}/{ENCODER}", "--ignore-not-found", "-o", "name"
        )
        found += proc.stdout.split()
    return found


def _front_args(cluster: Cluster, namespace: str) -> list[str]:
    dep = ok.get(cluster, namespace, f"deployment/{NAME}")
    (front,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "frontend"]
    return list(front["args"])


def test_the_operator_creates_wires_and_removes_the_encoders(
    cluster: Cluster, namespace: str, encoders_operator: OperatorThread
) -> None:
    ok.apply(cluster, namespace, _resource(SPEC))
    _reconciled(cluster, namespace)
    assert len(_existing(cluster, namespace)) == len(TYPES)
    owner = ok.get(cluster, namespace, f"mmis/{NAME}")
    assert ok.condition(owner, r.ENCODERS)["status"] == "True"
    for kind in TYPES:
        live = ok.get(cluster, namespace, f"{kind}/{ENCODER}")
        (ref,) = live["metadata"]["ownerReferences"]
        assert (ref["uid"], ref["controller"]) == (owner["metadata"]["uid"], True), kind
    service = ok.get(cluster, namespace, f"service/{ENCODER}")
    assert service["spec"]["clusterIP"] == "None"  # headless: one A record per encoder
    args = _front_args(cluster, namespace)
    assert args[-2:] == ["--encoder-service", f"{ENCODER}.{namespace}.svc:{r.ENCODER_PORT}"]
    # the token's Secret exists (the operator created it; it never reads it)
    secret = routing.token_secret_name(NAME)
    assert cluster.kubectl("get", "-n", namespace, f"secret/{secret}", "-o", "name").stdout
    # the encoder pod passes the namespace's admission (Pod Security restricted) as built
    template = ok.get(cluster, namespace, f"deployment/{ENCODER}")["spec"]["template"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "admission-check"},
        "spec": template["spec"],
    }
    proc = cluster.kubectl(
        "create", "--dry-run=server", "-n", namespace, "-f", "-", input=json.dumps(pod),
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0 and "Warning" not in proc.stderr, proc.stderr
    # spec.encoder removed: the objects go, the PD pods are as without it, the condition too
    cluster.kubectl(
        "patch", "mmis", NAME, "-n", namespace, "--type=json",
        "-p", json.dumps([{"op": "remove", "path": "/spec/encoder"}]),
    )  # fmt: skip
    _reconciled(cluster, namespace)
    assert _existing(cluster, namespace) == []
    owner = ok.get(cluster, namespace, f"mmis/{NAME}")
    assert ok.find_condition(owner, r.ENCODERS) is None
    assert status.ENCODER_FALLBACKS not in owner.get("status", {})
    plain = builders.frontend_container(parse_spec(owner["spec"]), NAME, namespace)
    assert _front_args(cluster, namespace) == plain["args"]
    assert "--encoder-service" not in plain["args"]
