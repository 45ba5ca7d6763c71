"""``spec.encoder`` against a real kube-apiserver: the schema's bounds and CEL rules refuse what
the operator's parser refuses (tests/operator/test_encoder.py), the server stores no default for
it, ``status.encoderFallbacksPerMinute`` survives a status write (the status schema is not
free-form: an undeclared field would be pruned), and the encoder objects the operator builds
are accepted by the API server as they are (server-side dry run, Strict field validation)."""

from __future__ import annotations

import copy
import json
import subprocess
from typing import Any

import pytest
from kubecluster import Cluster

from mmis_operator import encoder
from mmis_operator import kube as r
from mmis_operator.spec import parse_spec

pytestmark = pytest.mark.controlplane

VALID: dict[str, Any] = {
    "apiVersion": "mmis.dev/v1alpha1",
    "kind": "MMInferenceService",
    "metadata": {"name": "sample"},
    "spec": {"model": {"id": "llava-hf/llava-1.5-7b-hf"}},
}
AUTO = {"enabled": True, "maxReplicas": 4, "target": 8}


def _create(
    cluster: Cluster, namespace: str, spec: dict[str, Any], dry_run: bool = True
) -> subprocess.CompletedProcess[str]:
    obj = copy.deepcopy(VALID)
    obj["spec"].update(spec)
    flags = ["--dry-run=server"] if dry_run else []
    return cluster.kubectl(
        "create", *flags, "-n", namespace, "-o", "json", "-f", "-",
        input=json.dumps(obj), check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("value", "field", "message"),
    [
        ({"replicas": 0}, "spec.encoder.replicas", "greater than or equal to 1"),
        ({"replicas": 1001}, "spec.encoder.replicas", "less than or equal to 1000"),
        ({"replicas": "2"}, "spec.encoder.replicas", "must be of type integer"),
        ({"resources": {"gpus": 65}}, "spec.encoder.resources.gpus", "less than or equal to 64"),
        ({"resources": {"cpu": "0"}}, "spec.encoder.resources.cpu", "positive quantity"),
        ({"resources": {"memory": "lots"}}, "spec.encoder.resources.memory", "positive quantity"),
        (
            {"autoscaling": {"enabled": True, "target": 2}},
            "spec.encoder.autoscaling",
            "enabled needs maxReplicas and target",
        ),
        (
            {"autoscaling": {**AUTO, "minReplicas": 5}},
            "spec.encoder.autoscaling",
            "minReplicas must not exceed maxReplicas",
        ),
        (
            {"autoscaling": {"maxReplicas": 1, "minReplicas": 2}},
            "spec.encoder.autoscaling",
            "minReplicas must not exceed maxReplicas",
        ),
        ({"autoscaling": {**AUTO, "target": 0}}, "spec.encoder.autoscaling.target", "positive"),
    ],
)
def test_the_schema_refuses_what_the_parser_refuses(
    cluster: Cluster, crd: None, namespace: str, value: Any, field: str, message: str
) -> None:
    proc = _create(cluster, namespace, {"encoder": value})
    assert proc.returncode != 0, proc.stdout
    assert field in proc.stderr and message in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "value",
    [
        {},
        {"replicas": 3, "resources": {"gpus": 0, "cpu": "500m", "memory": "6Gi"}},
        {"autoscaling": {**AUTO, "minReplicas": 2, "scaleDownStabilizationSeconds": 60}},
        {"autoscaling": {"enabled": False}},
        {"podTemplate": {"spec": {"containers": [{"name": "encoder", "env": [{"name": "A"}]}]}}},
    ],
)
def test_valid_encoders_are_stored_as_written(
    cluster: Cluster, crd: None, namespace: str, value: dict[str, Any]
) -> None:
    proc = _create(cluster, namespace, {"encoder": value})
    assert proc.returncode == 0, proc.stderr
    stored = json.loads(proc.stdout)["spec"]
    assert stored["encoder"] == value  # no default stored: the operator derives them
    parsed = parse_spec(stored).encoder
    assert parsed is not None
    assert parsed.replicas == value.get("replicas", 1)


def test_fallbacks_per_minute_survive_a_status_write(
    cluster: Cluster, crd: None, namespace: str
) -> None:
    proc = _create(cluster, namespace, {"encoder": {}}, dry_run=False)
    assert proc.returncode == 0, proc.stderr
    patch = {"status": {"encoderFallbacksPerMinute": 2.5, "notDeclared": 1}}
    cluster.kubectl(
        "patch", "mmis", "sample", "-n", namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps(patch),
    )  # fmt: skip
    got = json.loads(cluster.kubectl("get", "mmis", "sample", "-n", namespace, "-o", "json").stdout)
    assert got["status"]["encoderFallbacksPerMinute"] == 2.5
    assert "notDeclared" not in got["status"]  # what an undeclared field would have become


def test_the_encoder_objects_are_accepted_by_the_api_server(
    cluster: Cluster, crd: None, namespace: str
) -> None:
    """Every object of a spec with encoders (HPA kind; PodMonitor/ScaledObject need CRDs this
    control plane lacks) passes the API server's validation, Strict: no field it does not know."""
    owner = {
        **copy.deepcopy(VALID),
        "metadata": {"name": "sample", "namespace": namespace, "uid": "uid-1"},
    }
    owner["spec"]["encoder"] = {"resources": {"gpus": 0}, "autoscaling": AUTO}
    built = encoder.manifests(
        owner, parse_spec(owner["spec"]), "HorizontalPodAutoscaler", False, r.DEFAULT_SCRAPERS
    )
    objects = [m for m in built.values() if m is not None]
    assert {m["kind"] for m in objects} == {
        "NetworkPolicy",
        "Service",
        "Deployment",
        "HorizontalPodAutoscaler",
    }
    for manifest in objects:
        proc = cluster.kubectl(
            "create", "--dry-run=server", "--validate=strict", "-n", namespace, "-o", "json",
            "-f", "-", input=json.dumps(manifest), check=False,
        )  # fmt: skip
        assert proc.returncode == 0, f"{manifest['kind']}: {proc.stderr}"
