"""Reconciling one MMInferenceService: apply its children, keep its status, record events.

Owns (each a section below): :class:`Reconciler` (the reconcile of one resource, and the status
refreshes its children's events cause), the operator's optional integrations (its setting
and the API discovery that finds KEDA, prometheus-operator and the InferencePool API), and
:class:`Refresher`, which coalesces those refreshes per resource.

Invariants:
- ``reconcile`` is idempotent: it server-side-applies the same manifests for the same spec, so
  create, update, resume and the periodic resync can all call it.
- ``observedGeneration`` is raised only after every child of that generation was applied.
- Status goes through :func:`status.write` (fresh read, 409 -> retry), so conditions
  written by others (``CacheCoherent``) survive.
- An invalid spec never raises past the handler as anything but :class:`InvalidSpecError`,
  after the status says why (Degraded=True, reason InvalidSpec) and a Warning event is posted.
- Each condition transition posts one Event, typed by :func:`status.event_type`.
- A field the operator's settings refuse (``faultEvictRate`` without
  ``--allow-fault-injection``) is reported like an invalid spec (Degraded, reason
  FieldRefused, the field named) and nothing is applied: no pod ever runs with it.
- Status reads the pods (one LIST by the selector) whenever the Deployment is not fully rolled
  out and ready, so a pod's waiting reason or a scheduling failure shows in the same write.
  Pod events refresh the owner's status only when that pod shows a problem or the owner's
  last status had one (``_pod_problem_owners``, an in-memory hint; the resync repairs it).
- Optional children (Ingress, PodDisruptionBudget, the model claim) that the spec no longer
  asks for are deleted, only when this resource owns them.
- The integrations (an HPA or a KEDA ScaledObject for ``spec.autoscaling``, a PodMonitor) are
  chosen by API discovery and the operator's :class:`Integrations` setting; one that is no
  longer wanted (autoscaling off, HPA replaced by a ScaledObject) is deleted. Their absence is
  checked on a resource's first reconcile in this process, afterwards only for the kinds this
  process applied to it (``_integrations``, an in-memory hint), so a steady reconcile costs no
  extra request.
- ``spec.routing`` needs the operator installed with routing (:class:`Security`'s
  ``picker_cluster_role``, the chart's ``routing.enabled``): without it the condition
  ``Routing`` is False with reason RoutingNotEnabled, nothing of routing is created and the
  pods are built as without ``spec.routing`` (no event ports, no token). With it, the internal
  token's Secret ``NAME-internal`` is created before the Deployment (create only: a 409 leaves
  the existing one; the operator never reads, changes or deletes a Secret, garbage collection
  does) and the InferencePool and the endpoint picker's objects (routing.py) are applied only
  when the cluster serves inference.networking.k8s.io/v1 InferencePool; the ``Routing``
  condition says which (True, or False with reason InferencePoolAPIMissing and what to
  install). Without ``spec.routing`` those objects are deleted (the same in-memory hint,
  ``_routed``) and the Routing condition is removed. A RoleBinding whose roleRef changed (an
  earlier operator bound a Role) is deleted and created again: roleRef is immutable.
- ``spec.encoder`` needs the operator installed with encoders (``Security.encoders``, the
  chart's ``encoder.enabled``: the right to create the internal token's Secret): without it
  the condition ``Encoders`` is False with reason EncodersNotEnabled, nothing of the encoders
  is created and the pods are built as without ``spec.encoder``. With it the token's Secret
  ``NAME-internal`` is created (create only, as for routing; the two share it) before the pods
  that read it, the encoder objects (:mod:`mmis_operator.encoder`) are applied and
  ``Encoders`` is True. Encoder objects no longer wanted (the field gone, autoscaling off, the
  autoscaler kind changed) are deleted when this resource owns them: looked for on its first
  reconcile in this process, afterwards only the kinds this process applied (``_encoded``),
  never a kind whose API the cluster does not serve. Without ``spec.encoder`` the condition
  and ``status.encoderFallbacksPerMinute`` are removed.
- ``spec.adapters`` turns on ``--enable-lora`` in the pods (the list itself never reaches the
  pod template: the coherence probe pushes it, :mod:`mmis_operator.adapters`). With the
  operator's internal key (``Security.internal_key``, the chart's ``adapters.enabled``) the
  Secret ``NAME-internal`` is created for it too (create only), holding the token derived from
  the key, the resource's namespace, name and uid, so the operator can call the pods'
  ``/internal/*`` routes without ever reading a Secret; with a key, routing's and the encoders'
  Secret holds the same derived token. P0 reads it through an ``optional`` reference when only
  ``spec.adapters`` asks for it, so pods start without a key too (and refuse ``/internal/*``).
  A Secret created before the key existed keeps its random token (create only): the adapters'
  status then reports 403s until ``NAME-internal`` is deleted and the pods restarted.
- NetworkPolicies (``Security.network_policies``, on by default): ``NAME`` for the inference
  pods and, with routing, ``NAME-epp`` for the picker's; when the setting is off both are
  deleted when this resource owns them (looked for on its first reconcile in this process,
  ``_policies``).

Integrations:
- :class:`Integrations` is the operator's setting for them, read from the environment (the
  chart sets it; ``mmis operator`` has no flag for it yet):
  ``MMIS_OPERATOR_AUTOSCALER`` = ``auto`` (default: a ScaledObject when KEDA's CRD is served,
  else an HPA) | ``hpa`` | ``keda``; ``MMIS_OPERATOR_POD_MONITORS`` = ``auto`` (default: a
  PodMonitor per resource when the CRD is served) | ``off`` (e.g. the chart's own cluster-wide
  PodMonitor is enabled instead). A bad value fails at start-up, naming the variable.
- :class:`Discovery` asks the API server's discovery endpoint (readable by every
  authenticated user: no RBAC) and caches each answer for ``ttl`` seconds, so a CRD installed
  later is used within a minute and a reconcile costs no discovery request otherwise. An
  unreachable API server raises ``KubeError`` (retryable), never "absent".

Refreshes: the operator's watch handlers (``handlers.deployment_event`` / ``pod_event``) run on
kopf's event loop and only submit to the :class:`Refresher`; the refresh itself (API calls: a
LIST of pods, a GET and a PUT of the status) runs in one of the refresher's own threads, never
queued behind the reconciles of 100 resources created at once (they use the loop's default
executor). A Deployment rolling out emits several status updates within a second and each of
its pods several more: one refresh per burst instead of one per event
(benchmarks/bench_operator.py, benchmarks/README.md).
- At most one refresh per resource runs at a time, and it uses the newest Deployment event
  seen for it (``latest wins``): a stale event is never written after a newer one.
- Nothing submitted is lost: an event arriving while that resource's refresh runs is taken
  by the next round of the same drain task, which starts ``delay`` seconds later.
- A round runs the newest Deployment event first (it reads the pods itself while they are not all
  ready), then each pod's newest event (``Reconciler.pod_changed``: cheap unless a pod shows a
  problem or the resource's last status had one), so a pod problem surfaces in that round.
- Every status write from the Deployment (a reconcile's, a refresh's, a failure's) goes
  through :meth:`Reconciler.refresh_status`: under a per-resource lock it GETs the Deployment
  and writes the status computed from it. The reconcile runs in its own thread, beside the
  refresher's, so without the lock a write computed from an older read could land after one
  computed from a newer (a reconcile's apply response at 0/1 stored after a refresh's 1/1:
  Ready False right after Ready True, tests/kube/test_operator_mmis.py); with it the writes
  follow the order of their reads, and the last write reads the newest Deployment.
- A refresh that fails is logged and dropped: the next event or the resync timer repairs it.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mmis_operator import adapters, builders, encoder, routing, status
from mmis_operator import kube as r  # the resource's names (kube.py's first section)
from mmis_operator.builders import created_claim_name
from mmis_operator.kube import Kube, KubeError, object_path, service_path
from mmis_operator.spec import InvalidSpecError, ServiceSpec, parse_spec, refused_by_policy
from mmis_operator.status import Condition

logger = logging.getLogger(__name__)


# --- Reconciling one resource (was reconciler.py) -------------------------------------------------


class ApplyError(Exception):
    """Applying a child failed; ``permanent`` when retrying the same spec cannot help."""

    def __init__(self, message: str, permanent: bool) -> None:
        super().__init__(message)
        self.permanent = permanent


_API_VERSIONS = {
    "Ingress": "networking.k8s.io/v1",
    "PodDisruptionBudget": "policy/v1",
    "Service": "v1",
    "Deployment": "apps/v1",
    "HorizontalPodAutoscaler": "autoscaling/v2",
    "ScaledObject": "keda.sh/v1alpha1",
    "PodMonitor": "monitoring.coreos.com/v1",
    "NetworkPolicy": "networking.k8s.io/v1",
}


POOL_API_MISSING = (
    "spec.routing needs the Gateway API Inference Extension's InferencePool API "
    f"({routing.POOL_API_VERSION}), which this cluster does not serve: install the inference "
    "extension's CRDs v1.x (kubectl apply -f https://github.com/kubernetes-sigs/"
    "gateway-api-inference-extension/releases/download/v1.5.0/manifests.yaml); the endpoint "
    "picker and the InferencePool are then created at the next resync (a minute or two)"
)


ENCODERS_NOT_ENABLED = (
    "spec.encoder needs the operator installed with encoders: helm upgrade the mmis chart with "
    "--set encoder.enabled=true (it lets the operator create the internal token's Secret the "
    "encoders and front ends read); until then no encoder is created and the pods encode their "
    "images themselves"
)


ROUTING_NOT_ENABLED = (
    "spec.routing needs the operator installed with routing: helm upgrade the mmis chart with "
    "--set routing.enabled=true (it ships the picker's ClusterRole and lets the operator bind "
    "it, create the picker's ServiceAccount and RoleBinding and the internal token's Secret); "
    "until then nothing of routing is created and the pods publish no cache events"
)


@dataclasses.dataclass(frozen=True)
class Security:
    """What the operator's installation lets it do and asks of it (the chart's values, as
    ``mmis operator`` flags: :class:`mmis_operator.main.Options`).

    ``picker_cluster_role``: the chart's picker ClusterRole the operator may bind (empty:
    installed without ``routing.enabled``, so ``spec.routing`` is refused). ``encoders``: the
    chart's ``encoder.enabled`` (the operator may create the internal token's Secret), without
    which ``spec.encoder`` is refused the same way. ``network_policies``:
    render the NetworkPolicies; ``scrapers``: the NetworkPolicyPeer of whoever scrapes the
    pods' metrics; ``operator_namespace`` / ``operator_labels``: where the operator's own pods
    are and their labels, admitted to the ops port (the coherence probe); unknown (out of
    cluster) they are left out.
    """

    picker_cluster_role: str = ""
    network_policies: bool = True
    scrapers: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: copy.deepcopy(r.DEFAULT_SCRAPERS)
    )
    operator_namespace: str | None = None
    operator_labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    encoders: bool = False  # installed with encoder.enabled: spec.encoder is built
    # the chart's adapters.enabled (--internal-key): internal tokens are derived from it
    # (adapters.internal_token) and the operator may create NAME-internal for spec.adapters;
    # empty: tokens are drawn at random and the pods' /internal/* routes are out of its reach
    internal_key: str = dataclasses.field(default="", repr=False)

    def token(self, meta: Mapping[str, Any]) -> str:
        """The internal token to write into a new ``NAME-internal``: derived with the key,
        else drawn at random (nobody but the pods' Secret then knows it)."""
        if not self.internal_key:
            return secrets.token_hex(32)
        namespace, name, uid = meta["namespace"], meta["name"], str(meta.get("uid"))
        return adapters.internal_token(self.internal_key, namespace, name, uid)

    def operator_peer(self) -> dict[str, Any] | None:
        """The operator's pods as a NetworkPolicyPeer, or None when not known."""
        if not self.operator_namespace or not self.operator_labels:
            return None
        namespace = {r.NAMESPACE_NAME_LABEL: self.operator_namespace}
        return {
            "namespaceSelector": {"matchLabels": namespace},
            "podSelector": {"matchLabels": dict(self.operator_labels)},
        }


def _child_path(kind: str, namespace: str, name: str) -> str:
    return object_path(_API_VERSIONS[kind], kind, namespace, name)


def _settled(dep: Mapping[str, Any] | None) -> bool:
    """The Deployment has rolled out its template and every replica is ready."""
    if dep is None:
        return True  # no pods to read
    st, want = dep.get("status") or {}, int((dep.get("spec") or {}).get("replicas") or 0)
    seen = int(st.get("observedGeneration") or 0) >= int(dep["metadata"].get("generation") or 0)
    counts = [int(st.get(k) or 0) for k in ("replicas", "readyReplicas", "updatedReplicas")]
    return seen and counts == [want, want, want]


# how the API server refuses a server-side apply whose fields its schema lacks (Strict): the
# message names the field, e.g. `.spec.template.spec.containers[name="engine"].imagePullPolicyy:
# field not declared in schema`; the status is 500 for that, not 4xx (seen in tests/kube)
_SCHEMA_REFUSALS = ("failed to create typed patch object", "strict decoding error")


def rejected(exc: KubeError) -> bool:
    """The API server refused the manifest itself: retrying the same spec cannot help."""
    if exc.status in (400, 422):
        return True
    return exc.status == 500 and any(words in exc.message for words in _SCHEMA_REFUSALS)


class Reconciler:
    def __init__(
        self,
        kube: Kube,
        allow_fault_injection: bool = False,
        integrations: Integrations | None = None,
        discovery: Discovery | None = None,
        security: Security | None = None,
    ) -> None:
        self.kube = kube
        self.allow_fault_injection = allow_fault_injection
        self.security = Security() if security is None else security
        self.integrations = Integrations.from_env() if integrations is None else integrations
        self.discovery = Discovery(kube) if discovery is None else discovery
        self._pod_problem_owners: set[tuple[str, str]] = set()
        # per resource: the integration kinds this process applied (None: not looked yet)
        self._integrations: dict[tuple[str, str], set[str]] = {}
        # per resource: whether this process applied its routing objects (absent: not looked)
        self._routed: dict[tuple[str, str], bool] = {}
        # per resource: whether this process applied its NetworkPolicies (absent: not looked)
        self._policies: dict[tuple[str, str], bool] = {}
        # per resource: the encoder kinds this process applied (absent: not looked yet)
        self._encoded: dict[tuple[str, str], set[str]] = {}
        # per resource: held from the Deployment's GET to the status write (refresh_status)
        self._status_locks: dict[tuple[str, str], threading.Lock] = {}
        self._status_locks_guard = threading.Lock()

    def _wanted_integrations(
        self, body: Mapping[str, Any], spec: ServiceSpec
    ) -> dict[str, dict[str, Any] | None]:
        """Integration kind -> manifest (None: must not exist), for the kinds the cluster
        serves (an HPA always; a ScaledObject or PodMonitor when discovery finds its CRD)."""
        wanted: dict[str, dict[str, Any] | None] = {}
        kind = autoscaler_kind(self.integrations, self.discovery) if spec.autoscaling else None
        for candidate in builders.AUTOSCALER_KINDS:
            if candidate == "ScaledObject" and kind != candidate and not self.discovery.keda():
                continue  # KEDA is not installed: there can be no ScaledObject to delete
            wanted[candidate] = (
                builders.autoscaler(body, spec, candidate) if candidate == kind else None
            )
        if self.discovery.pod_monitors():
            monitors = pod_monitors_wanted(self.integrations, self.discovery)
            wanted["PodMonitor"] = builders.pod_monitor(body, spec) if monitors else None
        return wanted

    def _drop_unwanted(
        self, meta: Mapping[str, Any], wanted: Mapping[str, dict[str, Any] | None]
    ) -> None:
        key = (meta["namespace"], meta["name"])
        applied = self._integrations.get(key)
        for kind, manifest in wanted.items():
            if manifest is None and (applied is None or kind in applied):
                self._delete_owned(_child_path(kind, meta["namespace"], meta["name"]), meta)
        self._integrations[key] = {k for k, m in wanted.items() if m is not None}

    def _routing(
        self, body: Mapping[str, Any], spec: ServiceSpec
    ) -> tuple[list[dict[str, Any]], Condition | None]:
        """The routing objects to apply, and the Routing condition (None: no spec.routing)."""
        if spec.routing is None:
            return [], None
        if not self.security.picker_cluster_role:
            return [], Condition(r.ROUTING, "False", "RoutingNotEnabled", ROUTING_NOT_ENABLED)
        if not self.discovery.inference_pools():
            return [], Condition(r.ROUTING, "False", "InferencePoolAPIMissing", POOL_API_MISSING)
        name = body["metadata"]["name"]
        message = (
            f"InferencePool {name} and its endpoint picker {routing.picker_name(name)} are "
            f"applied: route to the pool from an HTTPRoute (backendRefs: group "
            f"{routing.POOL_GROUP}, kind {routing.POOL_KIND}, name {name})"
        )
        condition = Condition(r.ROUTING, "True", "InferencePoolApplied", message)
        scrapers = self.security.scrapers if self.security.network_policies else None
        role = self.security.picker_cluster_role
        return builders.routing_objects(body, spec, role, scrapers), condition

    def _pod_spec(self, spec: ServiceSpec) -> ServiceSpec:
        """The spec the pods are built from: routing the operator may not deploy (installed
        without a picker ClusterRole) is no routing for the pods (no event ports, no token
        Secret to read); likewise encoders (installed without ``encoder.enabled``)."""
        if spec.routing is not None and not self.security.picker_cluster_role:
            spec = dataclasses.replace(spec, routing=None)
        if spec.encoder is not None and not self.security.encoders:
            spec = dataclasses.replace(spec, encoder=None)
        return spec

    def _encoder_condition(self, body: Mapping[str, Any], spec: ServiceSpec) -> Condition | None:
        """The Encoders condition (None: no spec.encoder)."""
        if spec.encoder is None:
            return None
        if not self.security.encoders:
            return Condition(r.ENCODERS, "False", "EncodersNotEnabled", ENCODERS_NOT_ENABLED)
        meta = body["metadata"]
        address = builders.encoder_service(meta["name"], meta["namespace"])
        message = (
            f"encoder Deployment {r.encoder_name(meta['name'])} and its headless Service are "
            f"applied; the front ends ask {address} and encode locally whatever it does not "
            "answer (status.encoderFallbacksPerMinute)"
        )
        return Condition(r.ENCODERS, "True", "EncodersApplied", message)

    def _encoder_objects(
        self, body: Mapping[str, Any], pods: ServiceSpec
    ) -> dict[str, dict[str, Any] | None]:
        """Kind -> the encoder object to apply (None: to delete if this resource owns it)."""
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        if pods.encoder is None and self._encoded.get(key) == set():
            return {}  # none applied, none looked for again: a steady reconcile costs nothing
        auto = pods.encoder is not None and pods.encoder.autoscaling is not None
        kind = autoscaler_kind(self.integrations, self.discovery) if auto else ""
        monitors = pods.encoder is not None and pod_monitors_wanted(
            self.integrations, self.discovery
        )
        scrapers = self.security.scrapers if self.security.network_policies else None
        wanted = encoder.manifests(body, pods, kind, monitors, scrapers)
        # a kind the cluster does not serve has no object to delete (as _wanted_integrations)
        if wanted["ScaledObject"] is None and not self.discovery.keda():
            del wanted["ScaledObject"]
        if wanted["PodMonitor"] is None and not self.discovery.pod_monitors():
            del wanted["PodMonitor"]
        return wanted

    def _sync_encoders(
        self, meta: Mapping[str, Any], wanted: Mapping[str, dict[str, Any] | None]
    ) -> None:
        """Apply the wanted encoder objects and delete the unwanted ones this resource owns:
        looked for on its first reconcile in this process, afterwards only the kinds this
        process applied."""
        key = (meta["namespace"], meta["name"])
        before = self._encoded.get(key)
        for kind, manifest in wanted.items():
            if manifest is not None:
                self.kube.apply(manifest)
            elif before is None or kind in before:
                path = _child_path(kind, meta["namespace"], r.encoder_name(meta["name"]))
                self._delete_owned(path, meta)
        if wanted or before is None:
            self._encoded[key] = {k for k, m in wanted.items() if m is not None}

    def _apply_routing(self, manifest: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
        try:
            self.kube.apply(manifest)
        except KubeError as exc:
            if manifest["kind"] != "RoleBinding" or exc.status != 422:
                raise
            # roleRef is immutable: an earlier operator's binding (to its own Role, or another
            # ClusterRole name) goes, and the new one is created
            path = object_path(
                manifest["apiVersion"],
                "RoleBinding",
                meta["namespace"],
                manifest["metadata"]["name"],
            )
            self._delete_owned(path, meta)
            self.kube.apply(manifest)

    def _drop_policies(self, meta: Mapping[str, Any], wanted: bool) -> None:
        """Delete the resource's NetworkPolicies when the operator renders none: looked for on
        its first reconcile in this process, afterwards only if this process applied them."""
        key = (meta["namespace"], meta["name"])
        if not wanted and self._policies.get(key, True):
            for name in (meta["name"], routing.picker_name(meta["name"])):
                self._delete_owned(_child_path("NetworkPolicy", meta["namespace"], name), meta)
        self._policies[key] = wanted

    def _drop_routing(self, meta: Mapping[str, Any], wanted: bool) -> None:
        """Delete the routing objects the resource owns when it has none any more: looked for
        on its first reconcile in this process, afterwards only if this process applied them."""
        key = (meta["namespace"], meta["name"])
        if not wanted and self._routed.get(key, True):
            for api_version, kind, name in reversed(routing.object_refs(meta["name"])):
                if kind == routing.POOL_KIND and not self.discovery.inference_pools():
                    continue  # the API is not served: there is no pool to delete
                path = object_path(api_version, kind, meta["namespace"], name)
                try:
                    self._delete_owned(path, meta)
                except KubeError as exc:
                    if exc.status != 403:
                        raise
                    # RBAC from before spec.routing: what it cannot read, it never created
        self._routed[key] = wanted

    def _pods(self, namespace: str, name: str) -> list[dict[str, Any]]:
        path = f"/api/v1/namespaces/{namespace}/pods"
        return self.kube.list(path, r.selector_string(name))

    def write_status(
        self,
        namespace: str,
        name: str,
        deployment: Mapping[str, Any] | None = None,
        observed_generation: int | None = None,
        problem: status.Problem | None = None,
        routing_condition: Condition | None = None,
        drop_routing: bool = False,
        encoder_condition: Condition | None = None,
        drop_encoder: bool = False,
    ) -> dict[str, Any] | None:
        """Store the status computed from the fresh resource, ``deployment`` and its pods; with
        the reconcile's Routing and Encoders conditions, or removing them (``drop_routing``,
        ``drop_encoder``: the status field ``encoderFallbacksPerMinute`` goes with the latter)."""
        pods = [] if _settled(deployment) else self._pods(namespace, name)
        extra = tuple(c for c in (routing_condition, encoder_condition) if c is not None)
        dropped = ((r.ROUTING,) if drop_routing else ()) + ((r.ENCODERS,) if drop_encoder else ())
        gone = {status.ENCODER_FALLBACKS: None} if drop_encoder else {}

        def compute(obj: Mapping[str, Any]) -> status.DesiredStatus:
            desired = status.desired_status(
                obj, deployment, problem, pods, self.allow_fault_injection
            )
            fields = {**desired.fields, **gone}
            return status.DesiredStatus(fields, desired.conditions + extra, dropped)

        stored = status.write(self.kube, namespace, name, compute, observed_generation)
        key = (namespace, name)
        if stored is not None and status.pod_problem(pods) is not None:
            self._pod_problem_owners.add(key)
        else:
            self._pod_problem_owners.discard(key)
        return stored

    def refresh_status(
        self, namespace: str, name: str, when_gone: bool = False, **written: Any
    ) -> dict[str, Any] | None:
        """GET the Deployment and :meth:`write_status` from it (``written``: its keywords), one
        caller per resource at a time, so writes land in the order of their reads and the
        last one reflects the newest Deployment. A Deployment gone meanwhile writes nothing
        (its DELETED event re-creates it) unless ``when_gone`` (an invalid spec's status)."""
        key = (namespace, name)
        with self._status_locks_guard:
            lock = self._status_locks.setdefault(key, threading.Lock())
        with lock:
            deployment = self.kube.get(_child_path("Deployment", namespace, name))
            if deployment is None and not when_gone:
                return None
            return self.write_status(namespace, name, deployment, **written)

    def forget(self, namespace: str, name: str) -> None:
        """Drop what this process keeps for a deleted resource (its status lock, its hints)."""
        key = (namespace, name)
        with self._status_locks_guard:
            self._status_locks.pop(key, None)
        self._pod_problem_owners.discard(key)

    def _write_failure(self, namespace: str, name: str, problem: status.Problem | None) -> None:
        self.refresh_status(namespace, name, when_gone=True, problem=problem)

    def reconcile(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Apply the children of ``body``'s spec and record the result; returns the Deployment."""
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        try:
            spec = parse_spec(body.get("spec") or {})
            refused = refused_by_policy(spec, self.allow_fault_injection)
            if refused is not None:
                raise refused
        except InvalidSpecError:
            self._write_failure(namespace, name, None)  # the status says InvalidSpec / refused
            raise
        claim = builders.model_claim(body, spec)
        pods = self._pod_spec(spec)
        manifests = [
            *([claim] if claim is not None else []),
            builders.deployment(body, pods),
            builders.service(body, spec),
        ]
        policies = self.security.network_policies
        if policies:
            peer = self.security.operator_peer()
            manifests.append(builders.network_policy(body, pods, self.security.scrapers, peer))
        optional = {
            "Ingress": builders.ingress(body, spec),
            "PodDisruptionBudget": builders.disruption_budget(body, spec),
        }
        manifests += [m for m in optional.values() if m is not None]
        integrations = self._wanted_integrations(body, spec)
        manifests += [m for m in integrations.values() if m is not None]
        routed, routing_condition = self._routing(body, spec)
        encoder_condition = self._encoder_condition(body, spec)
        applied: dict[str, dict[str, Any]] = {}
        try:
            # before the pods that read it (the picker's, the encoders' and the front ends')
            keyed = pods.adapters is not None and bool(self.security.internal_key)
            if pods.routing is not None or pods.encoder is not None or keyed:
                self.kube.create(builders.token_secret(body, self.security.token(meta)))
            encoders = self._encoder_objects(body, pods)
            for manifest in manifests:
                applied[manifest["kind"]] = self.kube.apply(manifest)
            self._sync_encoders(meta, encoders)
            for manifest in routed:  # the picker's Deployment and Service are not the resource's
                self._apply_routing(manifest, meta)
            for kind, wanted in optional.items():
                if wanted is None:
                    self._delete_owned(_child_path(kind, namespace, name), meta)
            if claim is None:
                claim_path = object_path(
                    "v1", "PersistentVolumeClaim", namespace, created_claim_name(name)
                )
                self._delete_owned(claim_path, meta)
            self._drop_unwanted(meta, integrations)
            self._drop_routing(meta, bool(routed))
            self._drop_policies(meta, policies)
        except KubeError as exc:
            permanent = rejected(exc)
            reason = "InvalidPodTemplate" if permanent else "ApplyFailed"  # Strict: names field
            hint = (
                "fix spec.podTemplate / spec fields the API server rejected"
                if permanent
                else "check the operator's RBAC and the API server; retrying"
            )
            problem = status.Problem(reason, f"applying children failed: {exc.message}; {hint}")
            if exc.status != 0:  # with no answer there is nowhere to write it either
                self._write_failure(namespace, name, problem)
            raise ApplyError(str(problem.message), permanent) from exc
        # the status from the Deployment as it is now: events may have overtaken the apply's
        self.refresh_status(
            namespace,
            name,
            observed_generation=meta.get("generation"),
            routing_condition=routing_condition,
            drop_routing=spec.routing is None,
            encoder_condition=encoder_condition,
            drop_encoder=spec.encoder is None,
        )
        return applied["Deployment"]

    def _delete_owned(self, path: str, owner_meta: Mapping[str, Any]) -> None:
        found = self.kube.get(path)
        if found is None:
            return
        owners = found["metadata"].get("ownerReferences") or []
        if any(ref.get("uid") == owner_meta.get("uid") for ref in owners):
            self.kube.delete(path)

    def pod_changed(self, pod: Mapping[str, Any]) -> None:
        """A managed pod changed: refresh its owner's status if the pod shows a problem, or
        the owner's last status had one (so a recovery clears it); otherwise nothing."""
        meta = pod["metadata"]
        owner = (meta.get("labels") or {}).get(r.LABEL_SERVICE)
        if not owner:
            return
        key = (meta["namespace"], owner)
        if key not in self._pod_problem_owners and status.pod_problem([pod]) is None:
            return
        self.refresh_status(meta["namespace"], owner)

    def deployment_changed(self, deployment: Mapping[str, Any], deleted: bool) -> None:
        """A managed Deployment changed: refresh the owner's status from the Deployment as it
        is now, re-create it if deleted. Not from the event's body: kopf's watch can deliver
        an event after a refresh already read a newer Deployment (the reconcile's own, a
        pod's), and a status computed from the older body would undo it (a Ready written True
        at 1/1, then False at 0/1 from the event of the pod's creation)."""
        meta = deployment["metadata"]
        owner = (meta.get("labels") or {}).get(r.LABEL_SERVICE)
        if not owner:
            return
        if not deleted:
            self.refresh_status(meta["namespace"], owner)  # gone meanwhile: DELETED follows
            return
        body = self.kube.get(service_path(meta["namespace"], owner))
        if body is None or body["metadata"].get("deletionTimestamp"):
            self.forget(meta["namespace"], owner)
            return
        try:
            self.reconcile(body)
        except (InvalidSpecError, ApplyError) as exc:
            logger.warning("re-creating the Deployment of %s failed: %s", owner, exc)


# --- Optional integrations: the setting and API discovery (was integrations.py) -------------------

AUTOSCALERS = ("auto", "hpa", "keda")
POD_MONITORS = ("auto", "off")
ENV_AUTOSCALER = "MMIS_OPERATOR_AUTOSCALER"
ENV_POD_MONITORS = "MMIS_OPERATOR_POD_MONITORS"
KEDA = ("keda.sh/v1alpha1", "scaledobjects")
PROMETHEUS_OPERATOR = ("monitoring.coreos.com/v1", "podmonitors")
INFERENCE_POOL = ("inference.networking.k8s.io/v1", "inferencepools")


@dataclasses.dataclass(frozen=True)
class Integrations:
    autoscaler: str = "auto"  # which object spec.autoscaling becomes: auto | hpa | keda
    pod_monitors: str = "auto"  # a PodMonitor per resource: auto | off

    def __post_init__(self) -> None:
        if self.autoscaler not in AUTOSCALERS:
            raise ValueError(
                f"{ENV_AUTOSCALER} must be one of {', '.join(AUTOSCALERS)}, got {self.autoscaler!r}"
            )
        if self.pod_monitors not in POD_MONITORS:
            raise ValueError(
                f"{ENV_POD_MONITORS} must be one of {', '.join(POD_MONITORS)}, "
                f"got {self.pod_monitors!r}"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Integrations:
        env = os.environ if env is None else env
        return cls(
            autoscaler=env.get(ENV_AUTOSCALER, "auto").strip().lower() or "auto",
            pod_monitors=env.get(ENV_POD_MONITORS, "auto").strip().lower() or "auto",
        )


class Discovery:
    """Which optional resources the API server serves, cached for ``ttl`` seconds."""

    def __init__(
        self, kube: Kube, ttl: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.kube = kube
        self.ttl = ttl
        self.clock = clock
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], tuple[float, bool]] = {}

    def serves(self, group_version: str, plural: str) -> bool:
        key = (group_version, plural)
        now = self.clock()
        with self._lock:
            cached = self._seen.get(key)
        if cached is not None and now - cached[0] < self.ttl:
            return cached[1]
        found = self.kube.get(f"/apis/{group_version}")  # 404: the group is not served
        names = {res.get("name") for res in (found or {}).get("resources") or []}
        served = plural in names
        with self._lock:
            self._seen[key] = (now, served)
        return served

    def keda(self) -> bool:
        return self.serves(*KEDA)

    def pod_monitors(self) -> bool:
        return self.serves(*PROMETHEUS_OPERATOR)

    def inference_pools(self) -> bool:
        return self.serves(*INFERENCE_POOL)


def autoscaler_kind(settings: Integrations, discovery: Discovery) -> str:
    """The kind ``spec.autoscaling`` becomes: HorizontalPodAutoscaler or ScaledObject."""
    if settings.autoscaler == "hpa":
        return "HorizontalPodAutoscaler"
    if settings.autoscaler == "keda" or discovery.keda():
        return "ScaledObject"
    return "HorizontalPodAutoscaler"


def pod_monitors_wanted(settings: Integrations, discovery: Discovery) -> bool:
    return settings.pod_monitors != "off" and discovery.pod_monitors()


# --- Coalesced status refreshes (was refresh.py) --------------------------------------------------

THREADS = 4  # own threads: refreshes never queue behind a burst of reconciles
Key = tuple[str, str]  # (namespace, resource name)
Job = Callable[[], None]


@dataclasses.dataclass
class _Pending:
    deployment: Job | None = None
    pods: dict[str, Job] = dataclasses.field(default_factory=dict)  # pod name -> newest


class Refresher:
    """Per-resource latest-wins refreshes; ``submit_*`` must be called on the event loop."""

    def __init__(self, delay: float = 0.2, threads: int = THREADS) -> None:
        if delay < 0:
            raise ValueError(f"refresh delay must not be negative, got {delay}")
        self.delay = delay
        self.threads = threads
        self._executor: ThreadPoolExecutor | None = None  # made on first use
        self._pending: dict[Key, _Pending] = {}
        self._drains: dict[Key, asyncio.Task[None]] = {}

    def submit_deployment(self, key: Key, job: Job) -> None:
        self._slot(key).deployment = job

    def submit_pod(self, key: Key, pod: str, job: Job) -> None:
        self._slot(key).pods[pod] = job

    def _slot(self, key: Key) -> _Pending:
        slot = self._pending.setdefault(key, _Pending())
        if key not in self._drains:
            self._drains[key] = asyncio.get_running_loop().create_task(self._drain(key))
        return slot

    async def _drain(self, key: Key) -> None:
        try:
            while True:
                await asyncio.sleep(self.delay)  # let the rest of the burst arrive
                slot = self._pending.pop(key, None)
                if slot is None:
                    return  # no await between this check and the finally: nothing is missed
                jobs = [slot.deployment, *slot.pods.values()]
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(self.threads, "mmis-refresh")
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self._executor, _run_all, key, jobs)
        finally:
            self._drains.pop(key, None)

    async def idle(self) -> None:
        """Wait until every submitted refresh has run (tests)."""
        while self._drains:
            await asyncio.gather(*list(self._drains.values()), return_exceptions=True)


def _run_all(key: Key, jobs: list[Job | None]) -> None:
    for job in filter(None, jobs):
        try:
            job()
        except KubeError as exc:  # the next event or the resync timer will catch up
            logger.warning("status refresh of %s/%s failed: %s", *key, exc)
        except Exception:  # a bug: say so loudly, but keep refreshing the other resources
            logger.exception("status refresh of %s/%s failed", *key)
