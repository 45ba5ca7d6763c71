"""The MMInferenceService status, computed from the resource and its Deployment (pure).

Invariants:
- ``desired_status`` is a pure function of (resource, Deployment or None, problem); both the
  reconcile handler and the Deployment watcher call it, so they can never disagree.
- Ready is True only when every desired replica of the current template is ready; a
  resource scaled to zero is not Ready (reason ScaledToZero).
- Progressing is True while the Deployment has not finished rolling out the current template.
- Degraded is True for an invalid spec, a failed apply, or a Deployment that reports
  ProgressDeadlineExceeded / ReplicaFailure; each message says what to do next.
- ``observedGeneration`` is never lowered: only the reconcile handler raises it, after applying.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mmis_operator import children, conditions
from mmis_operator import resource as r
from mmis_operator.conditions import Condition
from mmis_operator.spec import InvalidSpecError, parse_spec


@dataclasses.dataclass(frozen=True)
class Problem:
    reason: str  # CamelCase, e.g. InvalidSpec, ApplyFailed
    message: str


@dataclasses.dataclass(frozen=True)
class DesiredStatus:
    fields: dict[str, Any]  # replicas, readyReplicas, updatedReplicas, selector, endpoint
    conditions: tuple[Condition, ...]


def _deployment_condition(dep: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    return conditions.find((dep.get("status") or {}).get("conditions") or (), kind)


def _deployment_problem(dep: Mapping[str, Any], selector: str) -> Problem | None:
    progress = _deployment_condition(dep, "Progressing")
    if progress and progress.get("reason") == "ProgressDeadlineExceeded":
        return Problem(
            "ProgressDeadlineExceeded",
            "pods did not become ready within the startup budget: run "
            f"`kubectl describe pods -l {selector}` (image pull, GPU capacity, model download) "
            "or raise spec.probes.startupTimeoutSeconds",
        )
    failure = _deployment_condition(dep, "ReplicaFailure")
    if failure and failure.get("status") == "True":
        return Problem(
            "ReplicaFailure",
            f"pods cannot be created: {failure.get('message') or 'see the Deployment events'} "
            "(check quotas, limit ranges and pod security admission)",
        )
    return None


def _rollout(dep: Mapping[str, Any] | None, desired: int) -> tuple[dict[str, int], bool]:
    if dep is None:
        return {"replicas": 0, "readyReplicas": 0, "updatedReplicas": 0}, False
    st = dep.get("status") or {}
    counts = {k: int(st.get(k) or 0) for k in ("replicas", "readyReplicas", "updatedReplicas")}
    seen = int(st.get("observedGeneration") or 0) >= int(dep["metadata"].get("generation") or 0)
    done = (
        seen
        and counts["updatedReplicas"] == desired
        and counts["replicas"] == desired
        and counts["readyReplicas"] >= desired
    )
    return counts, done


def desired_status(
    body: Mapping[str, Any], dep: Mapping[str, Any] | None, problem: Problem | None = None
) -> DesiredStatus:
    """Compute status fields and the Ready/Progressing/Degraded conditions."""
    name = body["metadata"]["name"]
    selector = r.selector_string(name)
    raw_spec = body.get("spec") or {}
    try:
        spec = parse_spec(raw_spec)
        endpoint = children.endpoint(body, spec)
        desired = spec.replicas
    except InvalidSpecError as exc:
        problem = problem or Problem("InvalidSpec", f"{exc}; the previous pods keep running")
        endpoint = ""
        desired = int((dep or {}).get("spec", {}).get("replicas") or 0)
    counts, done = _rollout(dep, desired)
    problem = problem or (None if dep is None else _deployment_problem(dep, selector))
    ready_n = counts["readyReplicas"]
    if dep is None and problem is not None:
        ready = Condition(r.READY, "False", problem.reason, problem.message)
    elif desired == 0:
        ready = Condition(
            r.READY,
            "False",
            "ScaledToZero",
            f"spec.replicas is 0: `kubectl scale mmis/{name} --replicas=1` to serve again",
        )
    elif dep is None:
        ready = Condition(r.READY, "False", "Creating", "the Deployment is being created")
    elif ready_n >= desired:
        ready = Condition(
            r.READY,
            "True",
            "AllReplicasReady",
            f"{ready_n}/{desired} pods ready; serving at {endpoint}",
        )
    else:
        ready = Condition(
            r.READY,
            "False",
            "ReplicasNotReady",
            f"{ready_n}/{desired} pods ready; pods load the model before /ready "
            f"passes: `kubectl get pods -l {selector}`",
        )
    if problem is not None and problem.reason in (
        "InvalidSpec",
        "InvalidPodTemplate",
        "ApplyFailed",
    ):
        progressing = Condition(r.PROGRESSING, "False", problem.reason, problem.message)
    elif done:
        progressing = Condition(
            r.PROGRESSING,
            "False",
            "RolloutComplete",
            f"all {desired} pods run the current template",
        )
    else:
        progressing = Condition(
            r.PROGRESSING,
            "True",
            "RollingOut",
            f"updated {counts['updatedReplicas']}/{desired}, ready {ready_n}/{desired}",
        )
    if problem is not None:
        degraded = Condition(r.DEGRADED, "True", problem.reason, problem.message)
    else:
        degraded = Condition(r.DEGRADED, "False", "AsExpected", "no problem detected")
    fields: dict[str, Any] = {**counts, "selector": selector, "endpoint": endpoint}
    return DesiredStatus(fields, (ready, progressing, degraded))


def merged_status(
    current: Mapping[str, Any] | None,
    desired: DesiredStatus,
    generation: int | None,
    observed_generation: int | None = None,
    now: str | None = None,
) -> dict[str, Any]:
    """The new status object: ``current`` with fields replaced and conditions upserted."""
    status = {**(current or {}), **desired.fields}
    for cond in desired.conditions:
        status["conditions"] = conditions.upsert(status.get("conditions"), cond, generation, now)
    if observed_generation is not None:
        status["observedGeneration"] = max(
            observed_generation, int(status.get("observedGeneration") or 0)
        )
    return status
