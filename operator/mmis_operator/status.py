"""The MMInferenceService's status: its conditions, what it should say, and the one writer.

Owns (each a section below): conditions (upsert one without touching the others, find
transitions); Ready, Progressing, Degraded and the status fields, computed from the resource,
its Deployment and its pods; ``CacheCoherent`` and ``status.cache``, computed from the pods'
drift stats (the coherence probe, :mod:`mmis_operator.probe`, fetches them); and
:func:`write`, the one writer of a resource's status, with the one rule for its Events. Both
the reconciler (Ready/Progressing/Degraded) and the coherence probe (``CacheCoherent`` and
``status.cache``) store through :func:`write`. Everything but :func:`write` is pure (no I/O;
:func:`upsert` reads the clock only when it is given no ``now``).

Invariants:
- Conditions: ``upsert`` returns a new list; the input is never mutated. Conditions of other
  types (for example ``CacheCoherent``, owned by the coherence probe) keep their position and
  content. ``lastTransitionTime`` changes only when ``status`` changes; a new reason or message
  with the same status keeps the old time (Kubernetes API conventions). ``status`` is always
  one of "True", "False", "Unknown"; anything else is a ValueError. Every condition written
  records the generation it describes (``observedGeneration``).
- A condition with ``hold_status`` carries no new evidence (e.g. ``CacheCoherent`` of an idle
  service). Against a stored True/False it keeps that status (so ``lastTransitionTime`` stays)
  and takes its own reason, with a message that says since when and quotes the last verdict;
  with no stored verdict it is written as given (``Unknown``). Once written, later held
  conditions of the same reason leave the entry as it is (the "since" time stays, nothing is
  rewritten). A held condition is never a transition, so it never causes an Event.
- ``desired_status`` is a pure function of (resource, Deployment or None, problem); both the
  reconcile handler and the Deployment watcher call it, so they can never disagree.
- Ready means serving: True while at least one inference pod behind the Service passes its
  readiness probe (``AllReplicasReady`` when every desired pod does, ``SomeReplicasReady``
  while a scale or rollout is under way or some pods have a problem); a scale or a rollout
  that keeps a pod serving never turns it False, so ``kubectl wait --for=condition=Ready``
  and alerts on it do not fire on a ``kubectl scale``. False only when nothing serves: no
  Deployment yet (``Creating``), scaled to zero (``ScaledToZero``), no ready pod
  (``ReplicasNotReady``, or the problem's reason when one is known).
- Progressing carries the rollout: True while the Deployment has not finished (``ScalingUp``,
  ``ScalingDown``, ``RollingOut`` when pods of an older template remain, or a problem's
  reason), False ``RolloutComplete`` when every desired pod runs the current template and is
  ready.
- Degraded is True for an invalid spec, a field the operator's settings refuse, a failed apply,
  a Deployment that reports ProgressDeadlineExceeded / ReplicaFailure, or a pod that cannot
  progress (:func:`pod_problem`: ImagePullBackOff, CrashLoopBackOff with the last exit, a
  missing Secret, Unschedulable with the scheduler's message unless another pod of the
  service is terminating and will free capacity, an eviction); each message
  names the pod and container and says what to do next. While pods are not all ready,
  Progressing carries the problem's reason (``kubectl get mmis -o wide`` shows it), and so
  does Ready while no pod serves.
- ``status.model`` is the model the pods serve, ``spec.model.id`` or ``spec.model.path``
  (the Model printer column); an invalid spec leaves the one last written.
- ``observedGeneration`` is never lowered: only the reconcile handler raises it, after applying.
- CacheCoherent: each ready pod's front end answers ``GET /stats/cache`` with its drift window
  (``drift_rate``: drift misses / shadow hits, ``hit_rate``, ``retry_rate`` and the raw window
  deltas); :func:`evaluate` turns the answers of N pods and the spec's threshold into one
  condition and the ``status.cache`` object (``kubectl get mmis`` shows
  ``status.cache.driftRate`` as ``Drift``). The same probe results always give the same
  condition and dict.
- The condition is judged on the *worst* pod (one drifting pod is actionable on its own):
  False / ``DriftRateHigh`` when its rate exceeds the threshold, True / ``DriftRateNormal``
  otherwise; the message names that rate, the threshold and the pod. ``Unknown`` when there is
  nothing to judge: ``NoData`` (no ready pod), ``ProbeFailed`` (no pod answered).
- No traffic (pods answer, but no shadow hit in any pod's window, so a 0.0 rate carries no
  evidence) is ``NoTraffic`` with ``hold_status``: the stored True/False verdict is kept, its
  message says since when the window had no traffic, and no Event is posted; with no verdict
  yet it is ``Unknown``. A healthy service that goes idle and busy again never flaps through
  ``Unknown``.
- ``status.cache`` rates are pooled over the answering pods (sums of the window deltas) and
  rounded, so an unchanged picture never rewrites the status.
- A malformed answer is a :class:`StatsError` for that pod (treated as a failed probe), never
  an exception out of :func:`evaluate`.
- Writing: read-modify-write on the freshest object. Each try GETs the resource, computes the
  update from it with the caller's pure ``compute``, merges it (:func:`merged_status`) and PUTs
  it with that object's ``resourceVersion``. A 409 (or no answer) re-reads and recomputes, so
  what others stored meanwhile (other fields, other condition types) survives; after
  ``RETRIES`` tries it raises ``KubeError(409)``.
- An unchanged status is not written; a resource that is gone or being deleted (before the
  read or between the read and the write: a 404 on the PUT) is left alone.
- Events follow a successful write only: one per condition transition, typed by
  :func:`event_type`; posting is best effort (the status already says it). Each transition is
  also one INFO log line (the operator's log says what changed, not each reconcile).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from mmis_operator import builders
from mmis_operator import kube as r  # the resource's names (kube.py's first section)
from mmis_operator.kube import Kube, KubeError, service_path
from mmis_operator.spec import InvalidSpecError, parse_spec, refused_by_policy

logger = logging.getLogger(__name__)


# --- Conditions (was conditions.py) ---------------------------------------------------------------

STATUSES = ("True", "False", "Unknown")


@dataclasses.dataclass(frozen=True)
class Condition:
    type: str
    status: str
    reason: str
    message: str
    hold_status: bool = False  # no new evidence: keep a stored True/False (see the module doc)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"condition {self.type}: status {self.status!r} not in {STATUSES}")
        if not self.reason or not self.reason[0].isupper() or " " in self.reason:
            raise ValueError(f"condition {self.type}: reason {self.reason!r} must be CamelCase")


@dataclasses.dataclass(frozen=True)
class Transition:
    type: str
    old_status: str | None  # None: the condition did not exist
    new: Condition


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def find(conditions: Iterable[Mapping[str, Any]], kind: str) -> Mapping[str, Any] | None:
    for item in conditions:
        if item.get("type") == kind:
            return item
    return None


def upsert(
    conditions: Sequence[Mapping[str, Any]] | None,
    condition: Condition,
    generation: int | None,
    now: str | None = None,
) -> list[dict[str, Any]]:
    """Insert or replace the condition of ``condition.type``; keep every other condition."""
    stamp = now or now_rfc3339()
    result: list[dict[str, Any]] = []
    replaced = False
    for item in conditions or ():
        if item.get("type") != condition.type:
            result.append(dict(item))
            continue
        replaced = True
        settled = held(item, condition, stamp) if condition.hold_status else condition
        same = item.get("status") == settled.status and item.get("lastTransitionTime")
        result.append(_entry(settled, generation, item["lastTransitionTime"] if same else stamp))
    if not replaced:
        fresh = held({}, condition, stamp) if condition.hold_status else condition
        result.append(_entry(fresh, generation, stamp))
    return result


def transitions(
    before: Sequence[Mapping[str, Any]] | None, new: Iterable[Condition]
) -> list[Transition]:
    """Conditions in ``new`` whose status differs from ``before`` (or that are new)."""
    found = []
    for condition in new:
        if condition.hold_status:
            continue  # keeps a stored status, or is Unknown where no verdict was ever given
        old = find(before or (), condition.type)
        old_status = None if old is None else old.get("status")
        if old_status != condition.status:
            found.append(Transition(condition.type, old_status, condition))
    return found


def held(stored: Mapping[str, Any], condition: Condition, stamp: str) -> Condition:
    """What a ``hold_status`` condition becomes over the ``stored`` entry of its type."""
    status = stored.get("status")
    if stored.get("reason") == condition.reason and status in STATUSES:
        return dataclasses.replace(condition, status=status, message=str(stored.get("message")))
    since = f"{condition.message} (since {stamp})"
    if status in ("True", "False"):
        last = f"last verdict {stored.get('reason')}: {stored.get('message')}"
        return dataclasses.replace(condition, status=status, message=f"{since}; {last}")
    return dataclasses.replace(condition, message=since)


def _entry(condition: Condition, generation: int | None, stamp: str) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "type": condition.type,
        "status": condition.status,
        "reason": condition.reason,
        "message": condition.message,
        "lastTransitionTime": stamp,
    }
    if generation is not None:
        entry["observedGeneration"] = generation
    return entry


# --- Ready, Progressing, Degraded and the status fields (was status.py) ---------------------------


@dataclasses.dataclass(frozen=True)
class Problem:
    reason: str  # CamelCase, e.g. InvalidSpec, ApplyFailed
    message: str


@dataclasses.dataclass(frozen=True)
class DesiredStatus:
    fields: dict[str, Any]  # replicas, readyReplicas, updatedReplicas, selector, endpoint, model
    conditions: tuple[Condition, ...]
    dropped: tuple[str, ...] = ()  # condition types to remove (Routing once spec.routing goes)


def _deployment_condition(dep: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    return find((dep.get("status") or {}).get("conditions") or (), kind)


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
        scheduled = find(st.get("conditions") or (), "PodScheduled") or {}
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


def _progress_reason(dep: Mapping[str, Any] | None, counts: Mapping[str, int], desired: int) -> str:
    """Why an unfinished rollout is unfinished: pods of an older template remain or none of
    the current one exists yet (``RollingOut``); the pod count differs from the desired one
    (``ScalingUp``/``ScalingDown``); all pods exist but some are not ready (``ScalingUp``), or
    the Deployment has not seen its newest generation with the count unchanged (a new
    template: ``RollingOut``)."""
    st, meta = (dep or {}).get("status") or {}, (dep or {}).get("metadata") or {}
    seen = int(st.get("observedGeneration") or 0) >= int(meta.get("generation") or 0)
    if counts["updatedReplicas"] < counts["replicas"] or not counts["updatedReplicas"]:
        return "RollingOut"
    if counts["replicas"] != desired:  # a scale, even before the Deployment has seen it
        return "ScalingDown" if counts["replicas"] > desired else "ScalingUp"
    return "ScalingUp" if seen else "RollingOut"  # new pods not ready yet, or a new template


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
        endpoint = builders.endpoint(body, spec)
        model: str | None = spec.model.name  # the id or the path (the Model column)
        desired = spec.replicas
        refused = refused_by_policy(spec, allow_fault_injection)
        if refused is not None and problem is None:
            problem = Problem("FieldRefused", f"{refused}; the previous pods keep running")
    except InvalidSpecError as exc:
        problem = problem or Problem("InvalidSpec", f"{exc}; the previous pods keep running")
        endpoint, model = "", None
        desired = int((dep or {}).get("spec", {}).get("replicas") or 0)
    counts, done = _rollout(dep, desired)
    problem = problem or (None if dep is None else _deployment_problem(dep, selector))
    ready_n = counts["readyReplicas"]
    if problem is None and dep is not None and not (done and ready_n >= desired):
        problem = pod_problem(pods)
    if problem is not None and dep is None:
        ready = Condition(r.READY, "False", problem.reason, problem.message)
    elif desired == 0:
        ready = Condition(
            r.READY,
            "False",
            "ScaledToZero",
            f"spec.replicas is 0: `kubectl scale mmis/{name} --replicas=1` to serve again",
        )
    elif dep is not None and ready_n >= desired:
        ready = Condition(
            r.READY,
            "True",
            "AllReplicasReady",
            f"{ready_n}/{desired} pods ready; serving at {endpoint}",
        )
    elif dep is not None and ready_n > 0:  # serving while the rest scale, roll or fail
        pending = problem.message if problem is not None else "see the Progressing condition"
        ready = Condition(
            r.READY,
            "True",
            "SomeReplicasReady",
            f"{ready_n}/{desired} pods ready; serving at {endpoint}; the others: {pending}",
        )
    elif problem is not None:
        ready = Condition(r.READY, "False", problem.reason, problem.message)
    elif dep is None:
        ready = Condition(r.READY, "False", "Creating", "the Deployment is being created")
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
            _progress_reason(dep, counts, desired),
            f"updated {counts['updatedReplicas']}/{desired}, ready {ready_n}/{desired}, "
            f"pods {counts['replicas']}",
        )
    if problem is not None:
        degraded = Condition(r.DEGRADED, "True", problem.reason, problem.message)
    else:
        degraded = Condition(r.DEGRADED, "False", "AsExpected", "no problem detected")
    fields: dict[str, Any] = {**counts, "selector": selector, "endpoint": endpoint}
    if model is not None:  # an invalid spec keeps the model last written
        fields["model"] = model
    return DesiredStatus(fields, (ready, progressing, degraded))


def merged_status(
    current: Mapping[str, Any] | None,
    desired: DesiredStatus,
    generation: int | None,
    observed_generation: int | None = None,
    now: str | None = None,
) -> dict[str, Any]:
    """The new status object: ``current`` with fields replaced (a field set to None is
    removed), conditions upserted and the ``dropped`` condition types removed."""
    status = {k: v for k, v in {**(current or {}), **desired.fields}.items() if v is not None}
    if desired.dropped and status.get("conditions"):
        kept = [c for c in status["conditions"] if c.get("type") not in desired.dropped]
        status["conditions"] = kept
    for cond in desired.conditions:
        status["conditions"] = upsert(status.get("conditions"), cond, generation, now)
    if observed_generation is not None:
        status["observedGeneration"] = max(
            observed_generation, int(status.get("observedGeneration") or 0)
        )
    return status


# --- CacheCoherent and status.cache (was coherence.py) --------------------------------------------

DRIFT_HIGH = "DriftRateHigh"
DRIFT_NORMAL = "DriftRateNormal"
NO_DATA = "NoData"
NO_TRAFFIC = "NoTraffic"
PROBE_FAILED = "ProbeFailed"
DIGITS = 4


class StatsError(ValueError):
    """A ``/stats/cache`` answer that is not the documented JSON object."""


@dataclasses.dataclass(frozen=True)
class PodStats:
    """One pod's drift window (the fields of ``GET /stats/cache``)."""

    drift_rate: float
    hit_rate: float
    retry_rate: float
    window_seconds: float
    shadow_hits: float
    drift_misses: float
    queries: float
    retries: float
    requests: float


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """The outcome of probing one pod: its stats, or why there are none."""

    pod: str
    stats: PodStats | None = None
    error: str | None = None
    lora: Mapping[str, str] | None = None  # adapter name -> path held (None: no LoRA in the pod)


@dataclasses.dataclass(frozen=True)
class Coherence:
    condition: Condition
    cache: dict[str, Any]


def parse_stats(body: Any) -> PodStats:
    """Validate a decoded ``/stats/cache`` body; :class:`StatsError` names the bad field."""
    if not isinstance(body, Mapping):
        raise StatsError(f"expected a JSON object, got {type(body).__name__}")
    values: dict[str, float] = {}
    for field in dataclasses.fields(PodStats):
        raw = body.get(field.name)
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise StatsError(f"field {field.name!r} must be a number, got {raw!r}")
        value = float(raw)
        if not math.isfinite(value) or value < 0:
            raise StatsError(f"field {field.name!r} must be finite and >= 0, got {raw!r}")
        values[field.name] = value
    return PodStats(**values)


def _ratio(numerator: float, denominator: float) -> float:
    return round(numerator / denominator, DIGITS) if denominator > 0 else 0.0


def _pooled(answered: Sequence[tuple[str, PodStats]], probed: int) -> dict[str, Any]:
    stats = [s for _, s in answered]
    hits = sum(s.hit_rate * s.queries for s in stats)
    return {
        "driftRate": _ratio(sum(s.drift_misses for s in stats), sum(s.shadow_hits for s in stats)),
        "hitRate": _ratio(hits, sum(s.queries for s in stats)),
        "retryRate": _ratio(sum(s.retries for s in stats), sum(s.requests for s in stats)),
        "windowSeconds": max(s.window_seconds for s in stats),
        "shadowHits": int(sum(s.shadow_hits for s in stats)),
        "driftMisses": int(sum(s.drift_misses for s in stats)),
        "podsProbed": probed,
        "podsAnswered": len(stats),
    }


def evaluate(results: Sequence[ProbeResult], threshold: float) -> Coherence:
    """The ``CacheCoherent`` condition and ``status.cache`` for these probe results."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"drift threshold must be within [0, 1], got {threshold}")
    probed = len(results)
    if probed == 0:
        condition = Condition(
            r.CACHE_COHERENT,
            "Unknown",
            NO_DATA,
            "no ready pod to probe: the drift rate is measured on ready pods' /stats/cache",
        )
        return Coherence(condition, {"podsProbed": 0, "podsAnswered": 0})
    answered = [(p.pod, p.stats) for p in results if p.stats is not None]
    if not answered:
        failures = "; ".join(f"{p.pod}: {p.error or 'no answer'}" for p in results[:3])
        condition = Condition(
            r.CACHE_COHERENT,
            "Unknown",
            PROBE_FAILED,
            f"no pod answered GET /stats/cache ({probed} probed): {failures}",
        )
        return Coherence(condition, {"podsProbed": probed, "podsAnswered": 0})
    cache = _pooled(answered, probed)
    window = f"{cache['windowSeconds']:g}s"
    if cache["shadowHits"] == 0:
        condition = Condition(
            r.CACHE_COHERENT,
            "Unknown",
            NO_TRAFFIC,
            f"no traffic in the last {window} window: no shadow hit on any of "
            f"{len(answered)} pod(s), so the drift rate carries no evidence",
            hold_status=True,
        )
        return Coherence(condition, cache)
    worst_pod, worst = max(answered, key=lambda item: (item[1].drift_rate, item[0]))
    rate = round(worst.drift_rate, DIGITS)
    cache["worstPod"] = worst_pod
    detail = (
        f"drift rate {rate:g} on pod {worst_pod} "
        f"({worst.drift_misses:g} misses / {worst.shadow_hits:g} shadow hits in {window})"
    )
    pods = f"{len(answered)}/{probed} pods answered, service-wide {cache['driftRate']:g}"
    if worst.drift_rate > threshold:
        condition = Condition(
            r.CACHE_COHERENT,
            "False",
            DRIFT_HIGH,
            f"{detail} exceeds the threshold {threshold:g} ({pods}); the front end retries "
            "with data, but check P1 restarts, its cache budget and the fault knob",
        )
    else:
        condition = Condition(
            r.CACHE_COHERENT,
            "True",
            DRIFT_NORMAL,
            f"{detail} is within the threshold {threshold:g} ({pods})",
        )
    return Coherence(condition, cache)


# --- status.encoderFallbacksPerMinute (spec.encoder) ---------------------------------------------

ENCODER_FALLBACKS = "encoderFallbacksPerMinute"
# P0's count of items it sent with pixels because no encoder answered (every reason summed)
FALLBACKS_METRIC = "mmis_encoder_fallbacks_total"


def fallbacks_total(text: str) -> float:
    """The sum of :data:`FALLBACKS_METRIC` over its series in a Prometheus text exposition
    (0 when absent: a front end that never fell back, or one without encoders); a malformed
    sample line of that metric is a :class:`StatsError`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(FALLBACKS_METRIC):
            continue
        rest = line[len(FALLBACKS_METRIC) :]
        if rest[:1] not in ("{", " "):
            continue  # another metric whose name starts with this one
        sample = rest.rsplit("}", 1)[-1].split()
        try:
            value = float(sample[0])
        except (IndexError, ValueError) as exc:
            raise StatsError(f"bad {FALLBACKS_METRIC} sample: {line[:120]!r}") from exc
        if not math.isfinite(value) or value < 0:
            raise StatsError(f"bad {FALLBACKS_METRIC} value: {line[:120]!r}")
        total += value
    return total


def fallbacks_per_minute(
    before: Mapping[str, tuple[float, float]], now: Mapping[str, tuple[float, float]]
) -> float | None:
    """Fallbacks per minute over the pods sampled both ``before`` and ``now`` (pod -> (seconds,
    counter total)); a counter that went down (the front end restarted) counts from 0, as
    Prometheus' ``rate`` does. None when no pod was sampled twice (nothing to say yet)."""
    count, seconds = 0.0, 0.0
    for pod, (t1, v1) in now.items():
        if pod not in before:
            continue
        t0, v0 = before[pod]
        if t1 <= t0:
            continue
        count += v1 - v0 if v1 >= v0 else v1
        seconds = max(seconds, t1 - t0)
    if seconds <= 0:
        return None
    return round(count * 60.0 / seconds, 2)


# --- The one status writer, and its Events (was status_writer.py) ---------------------------------

RETRIES = 8
HEALTHY = {
    r.READY: "True",
    r.DEGRADED: "False",
    r.CACHE_COHERENT: "True",
    r.ROUTING: "True",
    r.ENCODERS: "True",
}


def event_type(change: Transition) -> str | None:
    """``Warning`` when a condition misses its healthy status (Ready, CacheCoherent and Routing
    True, Degraded False), else ``Normal``; None: no Event. Progressing has no healthy status.

    Two exceptions, both "not news": a Ready written not-True for the first time (pods
    starting; a real problem shows as Degraded) is Normal, and a first Degraded=False posts
    nothing.
    """
    new, first = change.new, change.old_status is None
    if first and new.type == r.DEGRADED and new.status == "False":
        return None
    healthy = HEALTHY.get(new.type)
    if healthy is None or new.status == healthy or (first and new.type == r.READY):
        return "Normal"
    return "Warning"


def write(
    kube: Kube,
    namespace: str,
    name: str,
    compute: Callable[[Mapping[str, Any]], DesiredStatus],
    observed_generation: int | None = None,
) -> dict[str, Any] | None:
    """Store ``compute(fresh object)``; returns the stored (or unchanged) object, None if gone."""
    for _ in range(RETRIES):
        obj = kube.get(service_path(namespace, name))
        if obj is None or obj["metadata"].get("deletionTimestamp"):
            return None
        desired = compute(obj)
        old = obj.get("status") or {}
        generation = obj["metadata"].get("generation")
        new = merged_status(old, desired, generation, observed_generation)
        if new == old:
            return obj
        try:
            stored = kube.replace_status({**obj, "status": new})
        except KubeError as exc:
            if exc.status in (409, 0):
                continue
            if exc.status == 404:  # deleted between the read and the write
                return None
            raise
        for change in transitions(old.get("conditions"), desired.conditions):
            logger.info(
                "%s/%s: %s %s -> %s (%s): %s", namespace, name, change.type,
                change.old_status or "unset", change.new.status, change.new.reason,
                change.new.message,
            )  # fmt: skip
            kind = event_type(change)
            if kind is None:
                continue
            try:
                kube.post_event(stored, kind, change.new.reason, change.new.message)
            except KubeError as exc:
                logger.warning("could not post event %s: %s", change.new.reason, exc)
        return stored
    raise KubeError(409, f"status of {namespace}/{name} kept changing; will retry")
