"""The objects one MMInferenceService owns: a Deployment, a Service and, optionally, an Ingress.

Invariants:
- Pure functions: (owner metadata, parsed spec) in, manifest dicts out; no API calls.
- Every child carries a controller owner reference to the MMInferenceService (garbage
  collection deletes children with their owner) and the labels of ``resource.child_labels``.
- The pod selector is ``resource.selector_labels(name)``; the ``podTemplate`` override may add
  labels but can never change or drop the selector labels (a Deployment's selector is
  immutable, and the Service and scale subresource rely on it).
- Children are named after the owner, so reconciling twice yields identical manifests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mmis_operator import overrides
from mmis_operator import resource as r
from mmis_operator.pod import pod_spec
from mmis_operator.spec import ServiceSpec


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
            "annotations": {"kubectl.kubernetes.io/default-container": r.FRONTEND},
        },
        "spec": pod_spec(spec, name),
    }
    merged = overrides.merge(generated, spec.pod_template) if spec.pod_template else generated
    merged.setdefault("metadata", {}).setdefault("labels", {}).update(r.selector_labels(name))
    return merged


def deployment(owner: Mapping[str, Any], spec: ServiceSpec) -> dict[str, Any]:
    name = owner["metadata"]["name"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, name),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": r.selector_labels(name)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
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
    body: dict[str, Any] = {
        "rules": [
            {
                "host": cfg["host"],
                "http": {
                    "paths": [{"path": cfg["path"], "pathType": "Prefix", "backend": backend}]
                },
            }
        ]
    }
    if cfg.get("className"):
        body["ingressClassName"] = cfg["className"]
    if cfg.get("tlsSecretName"):
        body["tls"] = [{"hosts": [cfg["host"]], "secretName": cfg["tlsSecretName"]}]
    return {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": meta, "spec": body}


def endpoint(owner: Mapping[str, Any], spec: ServiceSpec) -> str:
    """Where clients reach the OpenAI API: the Ingress URL if any, else the in-cluster URL."""
    meta = owner["metadata"]
    cfg = spec.ingress
    if cfg.get("enabled"):
        scheme = "https" if cfg.get("tlsSecretName") else "http"
        path = str(cfg["path"]).rstrip("/")
        return f"{scheme}://{cfg['host']}{path}/v1"
    return f"http://{meta['name']}.{meta['namespace']}.svc:{spec.service_port}/v1"
