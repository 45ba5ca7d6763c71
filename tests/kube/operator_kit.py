"""What the kube tests that run the operator share (``tests/kube/test_*_mmis.py``): the
operator's options for one test namespace and kubectl helpers that fail with the namespace's
state. The ``operator`` fixture (``conftest.py``) runs it with :func:`options`.

Invariants: every helper talks to the test control plane's real API server through kubectl
(``kubecluster``); :func:`wait` fails the test, naming the kubectl error and showing the
namespace's objects, instead of raising.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubecluster import Cluster, kubectl_wait

from mmis_operator.main import Options

# what a failed wait shows of the namespace (kinds the namespace may lack are skipped)
SHOWN = "mmis,deploy,rs,pods,pvc,pdb,hpa,events"


def options(namespace: str, **extra: Any) -> Options:
    """The operator watching ``namespace`` only, with timeouts short enough for tests."""
    return Options(
        namespaces=(namespace,),
        resync_seconds=600.0,
        watch_server_timeout=20,
        watch_client_timeout=30.0,
        request_timeout=30.0,
        **extra,
    )


def apply(cluster: Cluster, namespace: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj))


def get(cluster: Cluster, namespace: str, *what: str) -> dict[str, Any]:
    return json.loads(cluster.kubectl("get", "-n", namespace, *what, "-o", "json").stdout)


def wait(cluster: Cluster, namespace: str, *args: str, timeout_s: float = 180) -> None:
    """``kubectl wait -n namespace args...`` (retried while the objects do not exist yet)."""
    proc = kubectl_wait(cluster, "-n", namespace, *args, timeout_s=timeout_s)
    if proc.returncode != 0:
        state = cluster.kubectl("get", "-n", namespace, SHOWN, "-o", "yaml", check=False)
        pytest.fail(f"kubectl wait {' '.join(args)} failed: {proc.stderr}\n{state.stdout[-8000:]}")


def find_condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """The resource's condition ``kind``, or None while it has none."""
    found = [c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind]
    return found[0] if found else None


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    """The resource's one condition ``kind`` (the test fails when it is absent)."""
    found = find_condition(obj, kind)
    assert found is not None, f"no {kind} condition in {obj.get('status')}"
    return found
