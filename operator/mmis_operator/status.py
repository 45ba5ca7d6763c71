"""The MMInferenceService status, computed from the resource and its Deployment (pure).

Invariants:
- ``desired_status`` is a pure function of (resource, Deployment or None, problem); both the
  reconcile handler and the Deployment watcher call it, so they can never disagree.
- Ready is True only when every desired replica of the current template is ready; a
  resource scaled to zero is not Ready (reason ScaledToZero).
- Progressing is True while the Deployment has not finished rolling out the current template.
- Degraded is True for an invalid spec, a field the operator's settings refuse, a failed apply,
  a Deployment that reports ProgressDeadlineExceeded / ReplicaFailure, or a pod that cannot
  progress (:func:`pod_problem`: ImagePullBackOff, CrashLoopBackOff with the last exit, a
  missing Secret, Unschedulable with the scheduler's message unless another pod of the
  service is terminating and will free capacity, an eviction); each message
  names the pod and container and says what to do next. While pods are not all ready, Ready
  and Progressing carry the same reason, so ``kubectl get mmis`` shows it.
- ``observedGeneration`` is never lowered: only the reconcile handler raises it, after applying.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from mmis_operator import children, conditions
from mmis_operator import resource as r
from mmis_operator.conditions import Condition
from mmis_operator.spec import InvalidSpecError, parse_spec, refused_by_policy


@dataclasses.dataclass(frozen=True)
class Problem:
    reason: str  # CamelCase, e.g. InvalidSpec, ApplyFailed
    message: str


@dataclasses.dataclass(frozen=True)
class DesiredStatus:
    fields: dict[str, Any]  # replicas, readyReplicas, updatedReplicas, selector, endpoint
    conditions: tuple[Condition, ...]
    dropped: tuple[str, ...] = ()  # condition types to remove (Routing once spec.routing goes)


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


# container waiting reasons that do not resolve by waiting, most actionable first
_WAITING = {
    "CreateContainerConfigError": "a Secret or ConfigMap the pod needs is missing: create "
    "it, or fix spec.auth.apiKeySecretRef / spec.model.tokenSecretRef",
    "ErrImagePull": "check spec.image (and imagePullSecrets through spec.podTemplate)",
    "ImagePullBackOff": "check spec.image (and imagePullSecrets through spec.podTemplate)",
    "InvalidImageName": "fix spec.image",
    "CreateContainerError": "see `kubectl describe pod`",
    "RunContainerError": "see `kubectl describe pod`",
    "CrashLoopBackOff": "see `kubectl logs --previous`",
}
_ORDER = (*_WAITING, "Evicted", "Unschedulable")
# reasons the reconciler reports itself (never from pods or the Deployment)
_OWN = ("InvalidSpec", "FieldRefused", "InvalidPodTemplate", "ApplyFailed")


def _container_problems(pod: str, statuses: Sequence[Mapping[str, Any]]) -> list[Problem]:
    found = []
    for cs in statuses:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason not in _WAITING:
            continue
        detail = waiting.get("message") or ""
        if reason == "CrashLoopBackOff":
            last = (cs.get("lastState") or {}).get("terminated") or {}
            detail = (
                f"last exit {last.get('reason') or 'unknown'} (exit code "
                f"{last.get('exitCode', '?')}, {int(cs.get('restartCount') or 0)} restarts)"
            )
        where = f"pod {pod}, container {cs.get('name')}"
        text = f"{where}: {reason}{': ' + detail if detail else ''}; {_WAITING[reason]}"
        found.append(Problem(reason, text))
    return found


def pod_problem(pods: Sequence[Mapping[str, Any]]) -> Problem | None:
    """The most actionable reason why one of ``pods`` cannot progress, or None."""
    found: list[Problem] = []
    # a pod that waits for what a terminating pod still holds (a rollout on a full GPU node)
    # is not a problem: the capacity comes free when that pod is gone
    freeing = any(p["metadata"].get("deletionTimestamp") for p in pods)
    for pod in sorted(pods, key=lambda p: str(p["metadata"].get("name"))):
        meta, st = pod["metadata"], pod.get("status") or {}
        if meta.get("deletionTimestamp"):
            continue
        name = meta.get("name")
        if st.get("reason") == "Evicted":
            found.append(Problem("Evicted", f"pod {name} was evicted: {st.get('message') or ''}"))
            continue
        scheduled = conditions.find(st.get("conditions") or (), "PodScheduled") or {}
        unschedulable = scheduled.get("status") == "False" and scheduled.get("reason") == (
            "Unschedulable"
        )
        if unschedulable and not freeing:
            found.append(
                Problem(
                    "Unschedulable",
                    f"pod {name} cannot be scheduled: {scheduled.get('message') or ''}; "
                    "free or add capacity, or lower spec.resources / spec.scheduling",
                )
            )
        statuses = [*(st.get("initContainerStatuses") or ()), *(st.get("containerStatuses") or ())]
        found += _container_problems(str(name), statuses)
    if not found:
        return None
    return min(found, key=lambda p: _ORDER.index(p.reason))


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
    body: Mapping[str, Any],
    dep: Mapping[str, Any] | None,
    problem: Problem | None = None,
    pods: Sequence[Mapping[str, Any]] = (),
    allow_fault_injection: bool = False,
) -> DesiredStatus:
    """Compute status fields and the Ready/Progressing/Degraded conditions from the resource,
    its Deployment and its pods (``allow_fault_injection``: the operator's setting)."""
    name = body["metadata"]["name"]
    selector = r.selector_string(name)
    raw_spec = body.get("spec") or {}
    try:
        spec = parse_spec(raw_spec)
        endpoint = children.endpoint(body, spec)
        desired = spec.replicas
        refused = refused_by_policy(spec, allow_fault_injection)
        if refused is not None and problem is None:
            problem = Problem("FieldRefused", f"{refused}; the previous pods keep running")
    except InvalidSpecError as exc:
        problem = problem or Problem("InvalidSpec", f"{exc}; the previous pods keep running")
        endpoint = ""
        desired = int((dep or {}).get("spec", {}).get("replicas") or 0)
    counts, done = _rollout(dep, desired)
    problem = problem or (None if dep is None else _deployment_problem(dep, selector))
    ready_n = counts["readyReplicas"]
    if problem is None and dep is not None and not (done and ready_n >= desired):
        problem = pod_problem(pods)
    if problem is not None and (dep is None or (desired > 0 and ready_n < desired)):
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
    if problem is not None and problem.reason in _OWN:
        progressing = Condition(r.PROGRESSING, "False", problem.reason, problem.message)
    elif problem is not None and not done:
        progressing = Condition(r.PROGRESSING, "True", problem.reason, problem.message)
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
    """The new status object: ``current`` with fields replaced, conditions upserted and the
    ``dropped`` condition types removed."""
    status = {**(current or {}), **desired.fields}
    if desired.dropped and status.get("conditions"):
        kept = [c for c in status["conditions"] if c.get("type") not in desired.dropped]
        status["conditions"] = kept
    for cond in desired.conditions:
        status["conditions"] = conditions.upsert(status.get("conditions"), cond, generation, now)
    if observed_generation is not None:
        status["observedGeneration"] = max(
            observed_generation, int(status.get("observedGeneration") or 0)
        )
    return status
