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
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from mmis_operator import children, status, status_writer
from mmis_operator import resource as r
from mmis_operator.kube import Kube, KubeError, object_path, service_path
from mmis_operator.spec import InvalidSpecError, parse_spec

logger = logging.getLogger(__name__)


class ApplyError(Exception):
    """Applying a child failed; ``permanent`` when retrying the same spec cannot help."""

    def __init__(self, message: str, permanent: bool) -> None:
        super().__init__(message)
        self.permanent = permanent


_API_VERSIONS = {"Ingress": "networking.k8s.io/v1", "Service": "v1", "Deployment": "apps/v1"}


def _child_path(kind: str, namespace: str, name: str) -> str:
    return object_path(_API_VERSIONS[kind], kind, namespace, name)


class Reconciler:
    def __init__(self, kube: Kube) -> None:
        self.kube = kube

    def write_status(
        self,
        namespace: str,
        name: str,
        deployment: Mapping[str, Any] | None = None,
        observed_generation: int | None = None,
        problem: status.Problem | None = None,
    ) -> dict[str, Any] | None:
        """Store the status computed from the fresh resource and ``deployment``."""
        return status_writer.write(
            self.kube,
            namespace,
            name,
            lambda obj: status.desired_status(obj, deployment, problem),
            observed_generation,
        )

    def _write_failure(self, namespace: str, name: str, problem: status.Problem | None) -> None:
        deployment = self.kube.get(_child_path("Deployment", namespace, name))
        self.write_status(namespace, name, deployment, problem=problem)

    def reconcile(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Apply the children of ``body``'s spec and record the result; returns the Deployment."""
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        try:
            spec = parse_spec(body.get("spec") or {})
        except InvalidSpecError:
            self._write_failure(namespace, name, None)  # the status says InvalidSpec
            raise
        manifests = [children.deployment(body, spec), children.service(body, spec)]
        wanted_ingress = children.ingress(body, spec)
        if wanted_ingress is not None:
            manifests.append(wanted_ingress)
        applied: dict[str, dict[str, Any]] = {}
        try:
            for manifest in manifests:
                applied[manifest["kind"]] = self.kube.apply(manifest)
            if wanted_ingress is None:
                self._delete_owned(_child_path("Ingress", namespace, name), meta)
        except KubeError as exc:
            permanent = exc.status in (400, 422)
            reason = "InvalidPodTemplate" if permanent else "ApplyFailed"
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
        self.write_status(namespace, name, deployment, observed_generation=meta.get("generation"))
        return deployment

    def _delete_owned(self, path: str, owner_meta: Mapping[str, Any]) -> None:
        found = self.kube.get(path)
        if found is None:
            return
        owners = found["metadata"].get("ownerReferences") or []
        if any(ref.get("uid") == owner_meta.get("uid") for ref in owners):
            self.kube.delete(path)

    def delete(self, body: Mapping[str, Any]) -> None:
        """Remove the children now (garbage collection would too, but later and not always)."""
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        for kind in _API_VERSIONS:
            self._delete_owned(_child_path(kind, namespace, name), meta)

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
