"""The objects one MMInferenceService owns: a Deployment, a Service and, optionally, an
Ingress, a PodDisruptionBudget, the model cache's PersistentVolumeClaim, an autoscaler (HPA or
KEDA ScaledObject, autoscaling.py), a PodMonitor (monitoring.py) and the routing objects (an
InferencePool and its endpoint picker, routing.py).

Invariants:
- Pure functions: (owner metadata, parsed spec) in, manifest dicts out; no API calls.
- Every child carries a controller owner reference to the MMInferenceService (garbage
  collection deletes children with their owner) and the labels of ``resource.child_labels``.
- The pod selector is ``resource.selector_labels(name)``; the ``podTemplate`` override may add
  labels but can never change or drop the selector labels (a Deployment's selector is
  immutable, and the Service and scale subresource rely on it).
- Children are named after the owner, so reconciling twice yields identical manifests.
- The Ingress routes only ``INGRESS_ROUTES`` (the OpenAI API and /health) under its path; the
  Service exposes only the ``http`` port, never ``ops``.
- The rollout strategy comes from ``spec.rollout`` (default surge 0, unavailable 1: a rollout
  never waits for a GPU the node does not have); the PDB from ``spec.disruption``.
- With ``spec.autoscaling`` on, the autoscaler owns the resource's ``spec.replicas`` (through
  its scale subresource) and the Deployment runs that number clamped into [min, max].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mmis_operator import autoscaling, monitoring, overrides, quantity, routing
from mmis_operator import resource as r
from mmis_operator.pod import MODEL_CACHE_VOLUME, claim_name, pod_spec
from mmis_operator.spec import ServiceSpec

# what the Ingress routes: the OpenAI API and the health probe, nothing else (the front end's
# /metrics and /stats/cache are on the ops port, which no Service exposes)
INGRESS_ROUTES = ("/v1", "/health")


class OwnerError(ValueError):
    """The owner metadata lacks a field needed to reference it (name, namespace, uid)."""


def owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    meta = owner.get("metadata") or {}
    missing = [k for k in ("name", "uid") if not meta.get(k)]
    if missing:
        raise OwnerError(f"owner metadata lacks {', '.join(missing)}")
    return {
        "apiVersion": r.API_VERSION,
        "kind": r.KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(owner: Mapping[str, Any], name: str) -> dict[str, Any]:
    meta = owner.get("metadata") or {}
    if not meta.get("namespace"):
        raise OwnerError("owner metadata lacks namespace")
    return {
        "name": name,
        "namespace": meta["namespace"],
        "labels": r.child_labels(meta["name"]),
        "ownerReferences": [owner_reference(owner)],
    }


def pod_template(spec: ServiceSpec, name: str) -> dict[str, Any]:
    generated = {
        "metadata": {
            "labels": r.child_labels(name),
            "annotations": {
                "kubectl.kubernetes.io/default-container": r.FRONTEND,
                **monitoring.scrape_annotations(spec.monitoring),
            },
        },
        "spec": pod_spec(spec, name),
    }
    merged = overrides.merge(generated, spec.pod_template) if spec.pod_template else generated
    merged.setdefault("metadata", {}).setdefault("labels", {}).update(r.selector_labels(name))
    return merged


def replicas(spec: ServiceSpec) -> int:
    """The Deployment's replicas: ``spec.replicas``, within the autoscaler's bounds if any."""
    return spec.autoscaling.clamp(spec.replicas) if spec.autoscaling else spec.replicas


def deployment(owner: Mapping[str, Any], spec: ServiceSpec) -> dict[str, Any]:
    name = owner["metadata"]["name"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, name),
        "spec": {
            "replicas": replicas(spec),
            "selector": {"matchLabels": r.selector_labels(name)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {
                    "maxSurge": spec.rollout.max_surge,
                    "maxUnavailable": spec.rollout.max_unavailable,
                },
            },
            "progressDeadlineSeconds": spec.startup_timeout_seconds + 600,
            "revisionHistoryLimit": 5,
            "template": pod_template(spec, name),
        },
    }


def service(owner: Mapping[str, Any], spec: ServiceSpec) -> dict[str, Any]:
    name = owner["metadata"]["name"]
    meta = _metadata(owner, name)
    if spec.service_annotations:
        meta["annotations"] = dict(spec.service_annotations)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": spec.service_type,
            "selector": r.selector_labels(name),
            "ports": [
                {
                    "name": r.HTTP_PORT_NAME,
                    "port": spec.service_port,
                    "targetPort": r.HTTP_PORT_NAME,
                    "protocol": "TCP",
                }
            ],
        },
    }


def ingress(owner: Mapping[str, Any], spec: ServiceSpec) -> dict[str, Any] | None:
    """The Ingress, or None when ``spec.ingress.enabled`` is false."""
    cfg = spec.ingress
    if not cfg.get("enabled"):
        return None
    name = owner["metadata"]["name"]
    meta = _metadata(owner, name)
    if cfg.get("annotations"):
        meta["annotations"] = dict(cfg["annotations"])
    backend = {"service": {"name": name, "port": {"number": spec.service_port}}}
    prefix = str(cfg["path"]).rstrip("/")
    paths = [
        {"path": f"{prefix}{route}", "pathType": "Prefix", "backend": backend}
        for route in INGRESS_ROUTES
    ]
    body: dict[str, Any] = {"rules": [{"host": cfg["host"], "http": {"paths": paths}}]}
    if cfg.get("className"):
        body["ingressClassName"] = cfg["className"]
    if cfg.get("tlsSecretName"):
        body["tls"] = [{"hosts": [cfg["host"]], "secretName": cfg["tlsSecretName"]}]
    return {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": meta, "spec": body}


def disruption_budget(owner: Mapping[str, Any], spec: ServiceSpec) -> dict[str, Any] | None:
    """The PodDisruptionBudget, or None when ``spec.disruption.enabled`` is false. Pods that
    are not ready may always be evicted (``AlwaysAllow``): a crash-looping pod never blocks
    a node drain."""
    if not spec.disruption.enabled:
        return None
    name = owner["metadata"]["name"]
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(owner, name),
        "spec": {
            "maxUnavailable": spec.disruption.max_unavailable,
            "selector": {"matchLabels": r.selector_labels(name)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def model_claim(owner: Mapping[str, Any], spec: ServiceSpec) -> dict[str, Any] | None:
    """The model cache's PersistentVolumeClaim when the operator creates it (no ``claimName``);
    owned by the resource, so it is deleted with it."""
    storage = spec.model.storage
    if not storage.create_claim:
        return None
    name = owner["metadata"]["name"]
    claim = claim_name(spec, name)
    meta = {**_metadata(owner, name), "name": claim}
    meta["labels"] = {**meta["labels"], "mmis.dev/volume": MODEL_CACHE_VOLUME}
    body: dict[str, Any] = {
        "accessModes": [storage.access_mode],
        "resources": {"requests": {"storage": quantity.format_bytes(storage.size_bytes)}},
    }
    if storage.storage_class:
        body["storageClassName"] = storage.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": body}


AUTOSCALER_KINDS = ("HorizontalPodAutoscaler", "ScaledObject")


def autoscaler(owner: Mapping[str, Any], spec: ServiceSpec, kind: str) -> dict[str, Any] | None:
    """The autoscaler of ``kind`` (one of :data:`AUTOSCALER_KINDS`), or None when
    ``spec.autoscaling`` is not enabled."""
    if spec.autoscaling is None:
        return None
    meta = _metadata(owner, owner["metadata"]["name"])
    if kind == "ScaledObject":
        return autoscaling.scaled_object(owner, meta, spec.autoscaling)
    return autoscaling.horizontal_pod_autoscaler(owner, meta, spec.autoscaling)


def pod_monitor(owner: Mapping[str, Any], spec: ServiceSpec) -> dict[str, Any] | None:
    """The PodMonitor, or None when ``spec.monitoring.podMonitor`` is false."""
    if not spec.monitoring.pod_monitor:
        return None
    meta = _metadata(owner, owner["metadata"]["name"])
    return monitoring.pod_monitor(owner, meta, spec.monitoring)


def routing_objects(owner: Mapping[str, Any], spec: ServiceSpec) -> list[dict[str, Any]]:
    """The InferencePool and its endpoint picker's objects, or none without ``spec.routing``."""
    if spec.routing is None:
        return []
    meta = _metadata(owner, owner["metadata"]["name"])
    return routing.manifests(owner, meta, spec.routing)


def endpoint(owner: Mapping[str, Any], spec: ServiceSpec) -> str:
    """Where clients reach the OpenAI API: the Ingress URL if any, else the in-cluster URL."""
    meta = owner["metadata"]
    cfg = spec.ingress
    if cfg.get("enabled"):
        scheme = "https" if cfg.get("tlsSecretName") else "http"
        path = str(cfg["path"]).rstrip("/")
        return f"{scheme}://{cfg['host']}{path}/v1"
    return f"http://{meta['name']}.{meta['namespace']}.svc:{spec.service_port}/v1"
