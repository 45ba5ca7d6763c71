"""``spec.frontend.apiServers`` against a real kube-apiserver: its bounds (1..64) are refused
by the schema, and the server stores no default for it nor for the P0 container's requests
(the operator derives them: ``spec.parse_frontend``; tests/operator/test_api_servers.py)."""

from __future__ import annotations

import copy
import json
import subprocess
from typing import Any

import pytest
from kubecluster import Cluster

from mmis_operator.spec import parse_spec

pytestmark = pytest.mark.controlplane

VALID: dict[str, Any] = {
    "apiVersion": "mmis.dev/v1alpha1",
    "kind": "MMInferenceService",
    "metadata": {"name": "sample"},
    "spec": {"model": {"id": "llava-hf/llava-1.5-7b-hf"}},
}


def _dry_run(
    cluster: Cluster, namespace: str, spec: dict[str, Any]
) -> subprocess.CompletedProcess[str]:
    obj = copy.deepcopy(VALID)
    obj["spec"].update(spec)
    return cluster.kubectl(
        "create", "--dry-run=server", "-n", namespace, "-o", "json", "-f", "-",
        input=json.dumps(obj), check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "should be greater than or equal to 1"),
        (-3, "should be greater than or equal to 1"),
        (65, "should be less than or equal to 64"),
        ("2", "must be of type integer"),
        (1.5, "must be of type integer"),
    ],
)
def test_out_of_range_api_servers_are_refused(
    cluster: Cluster, crd: None, namespace: str, value: Any, message: str
) -> None:
    proc = _dry_run(cluster, namespace, {"frontend": {"apiServers": value}})
    assert proc.returncode != 0, proc.stdout
    assert "spec.frontend.apiServers" in proc.stderr and message in proc.stderr, proc.stderr


@pytest.mark.parametrize("value", [1, 4, 64])
def test_in_range_api_servers_are_stored_as_written(
    cluster: Cluster, crd: None, namespace: str, value: int
) -> None:
    proc = _dry_run(cluster, namespace, {"frontend": {"apiServers": value}})
    assert proc.returncode == 0, proc.stderr
    stored = json.loads(proc.stdout)["spec"]
    assert stored["frontend"] == {"apiServers": value}
    assert parse_spec(stored).api_servers == value


def test_the_server_defaults_neither_the_count_nor_the_front_end_requests(
    cluster: Cluster, crd: None, namespace: str
) -> None:
    """What the API server stores for an unset field is what the operator parses as unset: one
    process for the default CPU request, and a CPU request of 16 picks 8 processes."""
    proc = _dry_run(cluster, namespace, {})
    assert proc.returncode == 0, proc.stderr
    stored = json.loads(proc.stdout)["spec"]
    assert "frontend" not in stored
    assert "frontendCpu" not in stored["resources"] and "frontendMemory" not in stored["resources"]
    assert stored["resources"]["gpus"] == 1  # the section's other defaults still apply
    parsed = parse_spec(stored)
    assert (parsed.api_servers, parsed.frontend_cpu, parsed.frontend_memory_bytes) == (
        1,
        "2",
        4 << 30,
    )
    proc = _dry_run(cluster, namespace, {"resources": {"frontendCpu": "16"}})
    assert proc.returncode == 0, proc.stderr
    assert parse_spec(json.loads(proc.stdout)["spec"]).api_servers == 8
