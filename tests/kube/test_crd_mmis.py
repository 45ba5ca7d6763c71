"""The MMInferenceService CRD against a real kube-apiserver: schema, defaults, CEL rules."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubecluster import Cluster

pytestmark = pytest.mark.controlplane

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
VALID: dict[str, Any] = {
    "apiVersion": "mmis.dev/v1alpha1",
    "kind": "MMInferenceService",
    "metadata": {"name": "sample"},
    "spec": {"model": {"id": "llava-hf/llava-1.5-7b-hf"}},
}


def _dry_run(
    cluster: Cluster, namespace: str, obj: dict[str, Any]
) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl(
        "create", "--dry-run=server", "-n", namespace, "-o", "json", "-f", "-",
        input=json.dumps(obj), check=False,
    )  # fmt: skip


def test_crd_is_established_with_the_short_name(cluster: Cluster, crd: None) -> None:
    names = cluster.kubectl("api-resources", "--api-group=mmis.dev", "-o", "wide").stdout
    assert "mminferenceservices" in names
    assert "mmis" in names.split()


def test_server_applies_defaults(cluster: Cluster, crd: None, namespace: str) -> None:
    proc = _dry_run(cluster, namespace, VALID)
    assert proc.returncode == 0, proc.stderr
    spec = json.loads(proc.stdout)["spec"]
    assert spec["replicas"] == 1
    assert spec["cache"]["type"] == "lru"
    assert spec["cache"]["size"] == "4Gi"
    assert spec["resources"]["gpus"] == 1
    assert spec["probes"]["startupTimeoutSeconds"] == 1800


def _with(path: str, value: Any) -> dict[str, Any]:
    obj = copy.deepcopy(VALID)
    target = obj["spec"]
    *parents, leaf = path.split(".")
    for key in parents:
        target = target.setdefault(key, {})
    target[leaf] = value
    return obj


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (
            _with("cache", {"type": "shm", "size": "8Gi", "shmSize": "4Gi"}),
            "with type shm, shmSize must be at least size",
        ),
        (_with("model", {"id": "a", "path": "/m"}), "set exactly one of id"),
        (_with("model", {}), "set exactly one of id"),
        (_with("replicas", -1), "spec.replicas"),
        (_with("resources.gpus", -1), "spec.resources.gpus"),
        (_with("cache.driftThreshold", 1.5), "spec.cache.driftThreshold"),
        (_with("resources.memory", "lots"), "spec.resources.memory must be a positive quantity"),
        (_with("ingress", {"enabled": True}), "enabled requires host"),
        (_with("cache.type", "redis"), "supported values"),
    ],
)
def test_invalid_resources_are_rejected_with_the_rule_message(
    cluster: Cluster, crd: None, namespace: str, obj: dict[str, Any], message: str
) -> None:
    proc = _dry_run(cluster, namespace, obj)
    assert proc.returncode != 0, f"accepted: {proc.stdout}"
    assert message in proc.stderr


def test_shm_rule_accepts_a_large_enough_store(cluster: Cluster, crd: None, namespace: str) -> None:
    obj = _with("cache", {"type": "shm", "size": "4Gi", "shmSize": "4096Mi"})
    proc = _dry_run(cluster, namespace, obj)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_pass_server_side_validation(
    cluster: Cluster, crd: None, namespace: str, example: Path
) -> None:
    proc = _dry_run(cluster, namespace, yaml.safe_load(example.read_text()))
    assert proc.returncode == 0, proc.stderr
