"""Reconciling one MMInferenceService: apply its children, keep its status, record events.

Invariants:
- ``reconcile`` is idempotent: it server-side-applies the same manifests for the same spec, so
  create, update, resume and the periodic resync can all call it.
- ``observedGeneration`` is raised only after every child of that generation was applied.
- Status goes through :func:`status_writer.write` (fresh read, 409 -> retry), so conditions
  written by others (``CacheCoherent``) survive.
- An invalid spec never raises past the handler as anything but :class:`InvalidSpecError`,
  after the status says why (Degraded=True, reason InvalidSpec) and a Warning event is posted.
- Each condition transition posts one Event, typed by :func:`status_writer.event_type`.
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
  chosen by API discovery and the operator's :class:`~integrations.Integrations` setting; one
  that is no longer wanted (autoscaling off, HPA replaced by a ScaledObject) is deleted. Their
  absence is checked on a resource's first reconcile in this process, afterwards only for the
  kinds this process applied to it (``_integrations``, an in-memory hint), so a steady
  reconcile costs no extra request.
- ``spec.routing``: the InferencePool and the endpoint picker's objects (routing.py) are
  applied only when the cluster serves inference.networking.k8s.io/v1 InferencePool; the
  ``Routing`` condition says which (True, or False with reason InferencePoolAPIMissing and what
  to install). Without ``spec.routing`` those objects are deleted (the same in-memory hint,
  ``_routed``) and the Routing condition is removed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from mmis_operator import children, routing, status, status_writer
from mmis_operator import resource as r
from mmis_operator.conditions import Condition
from mmis_operator.integrations import (
    Discovery,
    Integrations,
    autoscaler_kind,
    pod_monitors_wanted,
)
from mmis_operator.kube import Kube, KubeError, object_path, service_path
from mmis_operator.pod import created_claim_name
from mmis_operator.spec import InvalidSpecError, ServiceSpec, parse_spec, refused_by_policy

logger = logging.getLogger(__name__)


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
}


POOL_API_MISSING = (
    "spec.routing needs the Gateway API Inference Extension's InferencePool API "
    f"({routing.POOL_API_VERSION}), which this cluster does not serve: install the inference "
    "extension's CRDs v1.x (kubectl apply -f https://github.com/kubernetes-sigs/"
    "gateway-api-inference-extension/releases/download/v1.5.0/manifests.yaml); the endpoint "
    "picker and the InferencePool are then created at the next resync (a minute or two)"
)


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
    ) -> None:
        self.kube = kube
        self.allow_fault_injection = allow_fault_injection
        self.integrations = Integrations.from_env() if integrations is None else integrations
        self.discovery = Discovery(kube) if discovery is None else discovery
        self._pod_problem_owners: set[tuple[str, str]] = set()
        # per resource: the integration kinds this process applied (None: not looked yet)
        self._integrations: dict[tuple[str, str], set[str]] = {}
        # per resource: whether this process applied its routing objects (absent: not looked)
        self._routed: dict[tuple[str, str], bool] = {}

    def _wanted_integrations(
        self, body: Mapping[str, Any], spec: ServiceSpec
    ) -> dict[str, dict[str, Any] | None]:
        """Integration kind -> manifest (None: must not exist), for the kinds the cluster
        serves (an HPA always; a ScaledObject or PodMonitor when discovery finds its CRD)."""
        wanted: dict[str, dict[str, Any] | None] = {}
        kind = autoscaler_kind(self.integrations, self.discovery) if spec.autoscaling else None
        for candidate in children.AUTOSCALER_KINDS:
            if candidate == "ScaledObject" and kind != candidate and not self.discovery.keda():
                continue  # KEDA is not installed: there can be no ScaledObject to delete
            wanted[candidate] = (
                children.autoscaler(body, spec, candidate) if candidate == kind else None
            )
        if self.discovery.pod_monitors():
            monitors = pod_monitors_wanted(self.integrations, self.discovery)
            wanted["PodMonitor"] = children.pod_monitor(body, spec) if monitors else None
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
        if not self.discovery.inference_pools():
            return [], Condition(r.ROUTING, "False", "InferencePoolAPIMissing", POOL_API_MISSING)
        name = body["metadata"]["name"]
        message = (
            f"InferencePool {name} and its endpoint picker {routing.picker_name(name)} are "
            f"applied: route to the pool from an HTTPRoute (backendRefs: group "
            f"{routing.POOL_GROUP}, kind {routing.POOL_KIND}, name {name})"
        )
        condition = Condition(r.ROUTING, "True", "InferencePoolApplied", message)
        return children.routing_objects(body, spec), condition

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
    ) -> dict[str, Any] | None:
        """Store the status computed from the fresh resource, ``deployment`` and its pods; with
        the reconcile's Routing condition, or removing it (``drop_routing``)."""
        pods = [] if _settled(deployment) else self._pods(namespace, name)
        extra = (routing_condition,) if routing_condition is not None else ()
        dropped = (r.ROUTING,) if drop_routing else ()

        def compute(obj: Mapping[str, Any]) -> status.DesiredStatus:
            desired = status.desired_status(
                obj, deployment, problem, pods, self.allow_fault_injection
            )
            return status.DesiredStatus(desired.fields, desired.conditions + extra, dropped)

        stored = status_writer.write(self.kube, namespace, name, compute, observed_generation)
        key = (namespace, name)
        if stored is not None and status.pod_problem(pods) is not None:
            self._pod_problem_owners.add(key)
        else:
            self._pod_problem_owners.discard(key)
        return stored

    def _write_failure(self, namespace: str, name: str, problem: status.Problem | None) -> None:
        deployment = self.kube.get(_child_path("Deployment", namespace, name))
        self.write_status(namespace, name, deployment, problem=problem)

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
        claim = children.model_claim(body, spec)
        manifests = [
            *([claim] if claim is not None else []),
            children.deployment(body, spec),
            children.service(body, spec),
        ]
        optional = {
            "Ingress": children.ingress(body, spec),
            "PodDisruptionBudget": children.disruption_budget(body, spec),
        }
        manifests += [m for m in optional.values() if m is not None]
        integrations = self._wanted_integrations(body, spec)
        manifests += [m for m in integrations.values() if m is not None]
        routed, routing_condition = self._routing(body, spec)
        applied: dict[str, dict[str, Any]] = {}
        try:
            for manifest in manifests:
                applied[manifest["kind"]] = self.kube.apply(manifest)
            for manifest in routed:  # the picker's Deployment and Service are not the resource's
                self.kube.apply(manifest)
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
        deployment = applied["Deployment"]
        self.write_status(
            namespace,
            name,
            deployment,
            observed_generation=meta.get("generation"),
            routing_condition=routing_condition,
            drop_routing=spec.routing is None,
        )
        return deployment

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
        deployment = self.kube.get(_child_path("Deployment", meta["namespace"], owner))
        self.write_status(meta["namespace"], owner, deployment)

    def deployment_changed(self, deployment: Mapping[str, Any], deleted: bool) -> None:
        """A managed Deployment changed: refresh the owner's status, re-create it if deleted."""
        meta = deployment["metadata"]
        owner = (meta.get("labels") or {}).get(r.LABEL_SERVICE)
        if not owner:
            return
        if not deleted:
            self.write_status(meta["namespace"], owner, deployment)
            return
        body = self.kube.get(service_path(meta["namespace"], owner))
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        try:
            self.reconcile(body)
        except (InvalidSpecError, ApplyError) as exc:
            logger.warning("re-creating the Deployment of %s failed: %s", owner, exc)
