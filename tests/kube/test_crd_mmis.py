"""The MMInferenceService CRD against a real kube-apiserver: schema, defaults, CEL rules."""

from __future__ import annotations

import copy
import json
import re
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
        (_with("cache.type", "redis"), "spec.cache.type must be one of lru, shm"),
        (_with("engine.dtype", "fp8"), "spec.engine.dtype must be one of auto, bfloat16"),
        (_with("engine.gpuMemoryUtilization", 1.5), "must be a fraction in (0, 1]"),
        (_with("engine", {"maxLoras": 4, "maxCpuLoras": 2}), "must be at least maxLoras"),
        (_with("adapters", [{"name": "a b", "source": "/m/a"}]), "spec.adapters[].name must be"),
        (_with("adapters", [{"name": "a", "source": "s3://b/a"}]), "spec.adapters[].source must"),
        (
            _with("adapters", [{"name": "a", "source": "/m/a"}, {"name": "a", "source": "/m/b"}]),
            "Duplicate value",
        ),
    ],
)
def test_invalid_resources_are_rejected_with_the_rule_message(
    cluster: Cluster, crd: None, namespace: str, obj: dict[str, Any], message: str
) -> None:
    proc = _dry_run(cluster, namespace, obj)
    assert proc.returncode != 0, f"accepted: {proc.stdout}"
    assert message in proc.stderr


def _messages(stderr: str) -> list[str]:
    """The API server's error lines: one after "is invalid: ", or one per "* " bullet."""
    _, _, rest = stderr.partition(" is invalid: ")
    assert rest, stderr
    bullets = [line[2:] for line in rest.splitlines() if line.startswith("* ")]
    return bullets or [rest.strip()]


def test_negative_replicas_is_one_message(cluster: Cluster, crd: None, namespace: str) -> None:
    """The scale subresource's own check, not a second schema minimum (issue 48 item 6)."""
    proc = _dry_run(cluster, namespace, _with("replicas", -1))
    assert _messages(proc.stderr) == [
        ".spec.replicas: Invalid value: -1: should be a non-negative integer"
    ]


def test_a_bad_enum_hides_no_other_check(cluster: Cluster, crd: None, namespace: str) -> None:
    """Choices are CEL rules, so a bad one still lets the other rules run: one message per
    invalid field, each naming it and the fix, and no "rules were not checked"."""
    obj = _with("imagePullPolicy", "Sometimes")
    obj["spec"]["cache"] = {"type": "redis", "size": "lots"}
    obj["spec"]["resources"] = {"memory": "lots"}
    found = sorted(_messages(_dry_run(cluster, namespace, obj).stderr))
    assert found == [
        'spec.cache.size: Invalid value: "lots": spec.cache.size must be a quantity such as 4Gi',
        'spec.cache.type: Invalid value: "redis": spec.cache.type must be one of lru, shm',
        'spec.imagePullPolicy: Invalid value: "Sometimes": spec.imagePullPolicy must be one of '
        "Always, IfNotPresent, Never",
        'spec.resources.memory: Invalid value: "lots": spec.resources.memory must be a positive '
        "quantity such as 16Gi",
    ]


@pytest.mark.parametrize(
    ("path", "value", "fix"),
    [
        ("model", {"path": "models/llava"}, "must be an absolute path inside the pod, such as /"),
        ("monitoring.interval", "15", "such as 15s or 1m"),
    ],
)
def test_a_bad_path_names_the_field_and_the_fix_not_a_regex(
    cluster: Cluster, crd: None, namespace: str, path: str, value: Any, fix: str
) -> None:
    (message,) = _messages(_dry_run(cluster, namespace, _with(path, value)).stderr)
    field = "spec.model.path" if path == "model" else f"spec.{path}"
    assert message.startswith(f"{field}: ") and fix in message, message
    assert "should match" not in message


def test_printer_columns_show_a_path_model_and_the_drift(
    cluster: Cluster, crd: None, namespace: str
) -> None:
    """Model shows status.model (the id or the path the operator writes), Drift the pooled
    rate; both survive the status schema (pruning would blank them)."""
    obj = _with("model", {"path": "/models/llava"})
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(obj))
    stored = json.loads(cluster.kubectl("get", "-n", namespace, "mmis/sample", "-o", "json").stdout)
    stored["status"] = {"model": "/models/llava", "cache": {"driftRate": 0}}
    cluster.kubectl(
        "replace", "--subresource=status", "-n", namespace, "-f", "-", input=json.dumps(stored)
    )
    table = cluster.kubectl("get", "-n", namespace, "mmis/sample", "-o", "wide").stdout
    header, row = table.splitlines()
    starts = [m.start() for m in re.finditer(r"\S+", header)]  # kubectl aligns the columns
    ends = [*starts[1:], None]
    columns = {header[a:b].strip(): row[a:b].strip() for a, b in zip(starts, ends, strict=True)}
    assert columns["MODEL"] == "/models/llava" and columns["DRIFT"] == "0", table


def test_every_serving_setting_is_accepted(cluster: Cluster, crd: None, namespace: str) -> None:
    """The spec of tests/operator/golden/serving_settings.json (every spec.engine /
    spec.frontend serving setting and telemetry.logLevel set) passes the real API server,
    nothing pruned."""
    golden = ROOT / "tests" / "operator" / "golden" / "serving_settings.json"
    spec = json.loads(golden.read_text())["resource"]["spec"]
    every: dict[str, dict[str, Any]] = {k: spec[k] for k in ("engine", "frontend", "telemetry")}
    obj = copy.deepcopy(VALID)
    obj["spec"].update(copy.deepcopy(every))
    proc = _dry_run(cluster, namespace, obj)
    assert proc.returncode == 0, proc.stderr
    stored = json.loads(proc.stdout)["spec"]
    for section, values in every.items():
        assert {k: stored[section][k] for k in values} == values, section


def test_every_adapter_source_form_is_accepted(cluster: Cluster, crd: None, namespace: str) -> None:
    """The spec of tests/operator/golden/children_adapters.json (a path, a pvc:// and an hf://
    adapter, the engine's LoRA limits) passes the real API server, nothing pruned."""
    golden = ROOT / "tests" / "operator" / "golden" / "children_adapters.json"
    spec = json.loads(golden.read_text())["resource"]["spec"]
    obj = copy.deepcopy(VALID)
    obj["spec"].update(adapters=spec["adapters"], engine=spec["engine"])
    proc = _dry_run(cluster, namespace, obj)
    assert proc.returncode == 0, proc.stderr
    stored = json.loads(proc.stdout)["spec"]
    assert stored["adapters"] == spec["adapters"] and stored["engine"] == spec["engine"]


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
