from __future__ import annotations

import copy
from typing import Any

from mmis_operator import status


def _dep(
    replicas: int, ready: int, updated: int, gen: int = 2, seen: int = 2, **extra: Any
) -> dict:
    st = {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated}
    st["observedGeneration"] = seen
    st.update(extra)
    return {"metadata": {"generation": gen}, "spec": {"replicas": replicas}, "status": st}


def _by_type(desired: status.DesiredStatus) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in desired.conditions}


def test_no_deployment_yet(sample: dict[str, Any]) -> None:
    got = _by_type(status.desired_status(sample, None))
    assert got["Ready"] == ("False", "Creating")
    assert got["Progressing"] == ("True", "RollingOut")
    assert got["Degraded"] == ("False", "AsExpected")


def test_all_ready(sample: dict[str, Any]) -> None:
    desired = status.desired_status(sample, _dep(2, 2, 2))
    assert _by_type(desired)["Ready"] == ("True", "AllReplicasReady")
    assert _by_type(desired)["Progressing"] == ("False", "RolloutComplete")
    assert desired.fields["readyReplicas"] == 2
    assert desired.fields["endpoint"] == "http://llava.ml.svc:8000/v1"
    assert desired.fields["selector"] == (
        "app.kubernetes.io/instance=llava,app.kubernetes.io/name=mmis,mmis.dev/service=llava"
    )


def test_rolling_out_when_the_deployment_lags(sample: dict[str, Any]) -> None:
    # the deployment has not seen its newest generation: still rolling even if counts match
    got = _by_type(status.desired_status(sample, _dep(2, 2, 2, gen=3, seen=2)))
    assert got["Progressing"] == ("True", "RollingOut")
    partial = _by_type(status.desired_status(sample, _dep(2, 1, 2)))
    assert partial["Ready"] == ("False", "ReplicasNotReady")


def test_scaled_to_zero(sample: dict[str, Any]) -> None:
    sample["spec"]["replicas"] = 0
    got = _by_type(status.desired_status(sample, _dep(0, 0, 0)))
    assert got["Ready"] == ("False", "ScaledToZero")


def test_invalid_spec_is_degraded_with_the_field(sample: dict[str, Any]) -> None:
    sample["spec"]["cache"] = {"type": "shm", "size": "8Gi", "shmSize": "1Gi"}
    desired = status.desired_status(sample, _dep(2, 2, 2))
    got = {c.type: c for c in desired.conditions}
    assert got["Degraded"].status == "True"
    assert got["Degraded"].reason == "InvalidSpec"
    assert "spec.cache" in got["Degraded"].message
    assert got["Progressing"].reason == "InvalidSpec"
    assert got["Ready"].status == "True"  # the old pods still serve


def test_invalid_spec_without_deployment_is_not_ready_for_that_reason(
    sample: dict[str, Any],
) -> None:
    sample["spec"]["model"] = {}
    got = _by_type(status.desired_status(sample, None))
    assert got["Ready"] == ("False", "InvalidSpec")
    assert got["Degraded"] == ("True", "InvalidSpec")


def test_progress_deadline_is_degraded(sample: dict[str, Any]) -> None:
    dep = _dep(
        2,
        0,
        2,
        conditions=[
            {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}
        ],
    )
    desired = status.desired_status(sample, dep)
    (degraded,) = [c for c in desired.conditions if c.type == "Degraded"]
    assert degraded.reason == "ProgressDeadlineExceeded"
    assert "kubectl describe pods -l" in degraded.message


def test_merge_keeps_foreign_conditions_and_never_lowers_generation(sample: dict[str, Any]) -> None:
    current = {
        "observedGeneration": 5,
        "cache": {"driftRate": 0.2},
        "conditions": [{"type": "CacheCoherent", "status": "False", "reason": "HighDrift"}],
    }
    before = copy.deepcopy(current)
    desired = status.desired_status(sample, _dep(2, 2, 2))
    merged = status.merged_status(current, desired, generation=5, observed_generation=4)
    assert merged["observedGeneration"] == 5
    assert merged["cache"] == {"driftRate": 0.2}
    types = [c["type"] for c in merged["conditions"]]
    assert types == ["CacheCoherent", "Ready", "Progressing", "Degraded"]
    assert current == before
    raised = status.merged_status(current, desired, generation=6, observed_generation=6)
    assert raised["observedGeneration"] == 6
