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
    none_ready = _by_type(status.desired_status(sample, _dep(2, 0, 2)))
    assert none_ready["Ready"] == ("False", "ReplicasNotReady")


def test_ready_means_serving_while_a_scale_or_rollout_runs(sample: dict[str, Any]) -> None:
    """Ready stays True while one pod serves; Progressing carries the scale (issue 48 item 6)."""
    sample["spec"]["replicas"] = 3
    up = _conditions(status.desired_status(sample, _dep(3, 1, 3)))
    assert (up["Ready"].status, up["Ready"].reason) == ("True", "SomeReplicasReady")
    assert "1/3 pods ready; serving at http://llava.ml.svc:8000/v1" in up["Ready"].message
    assert _by_type(status.desired_status(sample, _dep(3, 1, 3)))["Progressing"] == (
        "True", "ScalingUp",
    )  # fmt: skip
    sample["spec"]["replicas"] = 1
    down = _by_type(status.desired_status(sample, _dep(3, 3, 3)))
    assert down["Ready"] == ("True", "AllReplicasReady")
    assert down["Progressing"] == ("True", "ScalingDown")
    sample["spec"]["replicas"] = 2
    rolling = _by_type(status.desired_status(sample, _dep(3, 2, 1)))  # an old pod remains
    assert rolling["Ready"] == ("True", "AllReplicasReady")
    assert rolling["Progressing"] == ("True", "RollingOut")
    # a new pod that cannot be scheduled is a problem (Degraded) but not an outage (Ready)
    stuck = _pod(
        "p-3",
        conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."}],
    )  # fmt: skip
    sample["spec"]["replicas"] = 3
    got = _by_type(status.desired_status(sample, _dep(3, 2, 3), pods=[stuck]))
    assert got == {
        "Ready": ("True", "SomeReplicasReady"),
        "Progressing": ("True", "Unschedulable"),
        "Degraded": ("True", "Unschedulable"),
    }


def test_status_model_is_the_id_or_the_path(sample: dict[str, Any]) -> None:
    """The Model printer column reads status.model (``.spec.model.id`` was blank for a path)."""
    assert status.desired_status(sample, None).fields["model"] == "llava-hf/llava-1.5-7b-hf"
    sample["spec"]["model"] = {"path": "/models/llava"}
    assert status.desired_status(sample, None).fields["model"] == "/models/llava"
    sample["spec"]["model"] = {}  # invalid: the model last written stays
    assert "model" not in status.desired_status(sample, None).fields


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


def _pod(name: str, **status_fields: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": status_fields}


def _waiting(container: str, reason: str, message: str = "", **extra: Any) -> dict[str, Any]:
    return {"name": container, "state": {"waiting": {"reason": reason, "message": message}},
            **extra}  # fmt: skip


def _conditions(desired: status.DesiredStatus) -> dict[str, Any]:
    return {c.type: c for c in desired.conditions}


def test_pod_problems_surface_with_the_real_reason(sample: dict[str, Any]) -> None:
    pulling = _pod("p-1", containerStatuses=[_waiting("engine", "ImagePullBackOff", "no such tag")])
    got = _conditions(status.desired_status(sample, _dep(2, 0, 2), pods=[pulling]))
    for kind in ("Ready", "Progressing", "Degraded"):
        assert got[kind].reason == "ImagePullBackOff", kind
    assert got["Degraded"].status == "True" and got["Progressing"].status == "True"
    assert "pod p-1, container engine" in got["Degraded"].message
    assert "no such tag" in got["Degraded"].message


def test_crash_loop_names_the_last_exit(sample: dict[str, Any]) -> None:
    crash = _waiting(
        "frontend", "CrashLoopBackOff", "back-off 5m0s",
        lastState={"terminated": {"reason": "OOMKilled", "exitCode": 137}}, restartCount=4,
    )  # fmt: skip
    pods = [_pod("p-1", containerStatuses=[crash])]
    degraded = _conditions(status.desired_status(sample, _dep(2, 1, 2), pods=pods))["Degraded"]
    assert degraded.reason == "CrashLoopBackOff"
    assert "last exit OOMKilled (exit code 137, 4 restarts)" in degraded.message


def test_unschedulable_carries_the_scheduler_message(sample: dict[str, Any]) -> None:
    message = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    pending = _pod(
        "p-2",
        conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": message}],
    )  # fmt: skip
    missing_secret = _pod(
        "p-1", containerStatuses=[_waiting("frontend", "CreateContainerConfigError",
                                           'secret "keys" not found')],
    )  # fmt: skip
    got = _conditions(status.desired_status(sample, _dep(2, 0, 2), pods=[pending]))
    assert got["Degraded"].reason == "Unschedulable"
    assert message in got["Degraded"].message
    both = _conditions(status.desired_status(sample, _dep(2, 0, 2), pods=[pending, missing_secret]))
    assert both["Degraded"].reason == "CreateContainerConfigError"  # the more actionable one
    assert 'secret "keys" not found' in both["Degraded"].message


def test_healthy_or_terminating_pods_are_no_problem(sample: dict[str, Any]) -> None:
    gone = _pod("p-old", containerStatuses=[_waiting("engine", "CrashLoopBackOff")])
    gone["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    starting = _pod("p-new", containerStatuses=[_waiting("engine", "ContainerCreating")])
    got = _by_type(status.desired_status(sample, _dep(2, 0, 2), pods=[gone, starting]))
    assert got["Degraded"] == ("False", "AsExpected")
    assert got["Ready"] == ("False", "ReplicasNotReady")


def test_fault_injection_is_reported_as_refused(sample: dict[str, Any]) -> None:
    sample["spec"]["engine"] = {"faultEvictRate": 0.2}
    got = _conditions(status.desired_status(sample, _dep(2, 2, 2)))
    assert got["Degraded"].reason == "FieldRefused"
    assert "spec.engine.faultEvictRate" in got["Degraded"].message
    allowed = status.desired_status(sample, _dep(2, 2, 2), allow_fault_injection=True)
    assert _by_type(allowed)["Degraded"] == ("False", "AsExpected")


def test_waiting_for_a_terminating_pods_gpus_is_no_problem(sample: dict[str, Any]) -> None:
    old = _pod("p-old", phase="Running")
    old["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    new = _pod(
        "p-new",
        conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."}],
    )  # fmt: skip
    rolling = _by_type(status.desired_status(sample, _dep(2, 1, 1), pods=[old, new]))
    assert rolling["Degraded"] == ("False", "AsExpected")
    stuck = _by_type(status.desired_status(sample, _dep(2, 1, 1), pods=[new]))
    assert stuck["Degraded"] == ("True", "Unschedulable")
