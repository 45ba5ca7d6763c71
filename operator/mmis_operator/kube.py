"""The Kubernetes side of the operator: the resource's names, and a small REST client.

Owns (each a section below): the names shared by the CRD, the builders and the handlers (one
place, so they never disagree: API group and kind, labels, container names and ports,
condition types; imported elsewhere as ``r``), and :class:`Kube`, a dict-in/dict-out
Kubernetes REST client (one per operator), with :class:`KubeError` and the object paths.

Invariants:
- The API group, version, plural and kind match ``crds/mminferenceservice.yaml``
  exactly.
- Everything the operator stores on objects (finalizer, kopf progress annotations, labels)
  lives under the ``mmis.dev`` prefix.
- The engine <-> front end ZMQ addresses are defined here once and passed to both containers.
- Each :class:`Kube` owns its own client configuration (never the process-global default), so
  several operators with different credentials can run in one process (tests, benchmarks).
- Every failure surfaces as :class:`KubeError` carrying the HTTP status (0: no answer, e.g. the
  API server is restarting) and the server's message; nothing hangs: requests have timeouts.
- Children are written with server-side apply under one field manager (``mmis-operator``), so
  a re-apply is idempotent and fields other managers own are left alone; with
  ``fieldValidation=Strict``, so a field the API does not know (a typo in ``podTemplate``)
  fails the apply with the field's path instead of vanishing.
- What changes is logged at INFO, nothing else: an object created (``apply`` answered 201,
  ``create`` 201), updated (the time of this manager's applied fields moved since this client
  last applied it: a no-op apply leaves it, and a status write by a controller does not touch
  it) or deleted; a no-op apply is DEBUG.
"""

from __future__ import annotations

import datetime
import json
import logging
import socket
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import kubernetes.client
import kubernetes.config
import urllib3

# --- The resource's names (was resource.py) -------------------------------------------------------

GROUP = "mmis.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "MMInferenceService"
PLURAL = "mminferenceservices"
SHORT_NAME = "mmis"

FINALIZER = f"{GROUP}/finalizer"
ANNOTATION_PREFIX = GROUP
FIELD_MANAGER = "mmis-operator"
REPORTING_COMPONENT = "mmis-operator"

# labels on every child and on the pods
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_SERVICE = f"{GROUP}/service"  # the owning MMInferenceService's name
APP_NAME = "mmis"
COMPONENT = "inference"
MANAGED_BY = "mmis-operator"

# containers and ports of an inference pod
FRONTEND = "frontend"
ENGINE = "engine"
HTTP_PORT = 8000
HTTP_PORT_NAME = "http"
# /metrics and /stats/cache (front end's --ops-port): pod to pod only, never on the Service
OPS_PORT = 8001
OPS_PORT_NAME = "ops"
# the engine's own probe endpoint (mmis engine --health-port): kubelet only
ENGINE_HEALTH_PORT = 8002
ENGINE_HEALTH_PORT_NAME = "engine-health"
ENGINE_INPUT_ADDRESS = "tcp://127.0.0.1:5570"
ENGINE_OUTPUT_ADDRESS = "tcp://127.0.0.1:5571"
# the encoder pods (spec.encoder, ``mmis encoder``; mmis_operator/encoder.py): the ROUTER the
# front ends reach through the headless Service NAME-encoder, and the health port that also
# serves the encoder's /metrics (kubelet and scrapers only)
ENCODER = "encoder"
ENCODER_PORT = 5580
ENCODER_PORT_NAME = "encoder"
ENCODER_HEALTH_PORT = 8003
ENCODER_HEALTH_PORT_NAME = "health"
SHM_VOLUME = "dshm"
SHM_MOUNT = "/dev/shm"
GPU_RESOURCE = "nvidia.com/gpu"
RUN_AS_USER = 1000

# NetworkPolicies (docs/SECURITY.md): who scrapes the pods' metrics by default, the labels
# kube-prometheus-stack's Prometheus pods carry (prometheus-operator sets them), in any
# namespace; the chart's networkPolicy.scrapers overrides it (the operator's
# --network-policy-scrapers)
DEFAULT_SCRAPERS: dict[str, Any] = {
    "namespaceSelector": {},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by the API server

# condition types the operator owns (CacheCoherent: the coherence probe, the others: reconciler;
# Routing only while spec.routing is set, Encoders while spec.encoder is)
READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
CACHE_COHERENT = "CacheCoherent"
ROUTING = "Routing"
ENCODERS = "Encoders"


def selector_labels(name: str) -> dict[str, str]:
    """The labels that select one service's pods (stable for the Deployment's lifetime)."""
    return {LABEL_NAME: APP_NAME, LABEL_INSTANCE: name, LABEL_SERVICE: name}


def selector_string(name: str) -> str:
    """``selector_labels`` as a label-selector string (``status.selector``, scale subresource)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def encoder_name(name: str) -> str:
    """The name of resource ``name``'s encoder Deployment, headless Service, PodMonitor,
    NetworkPolicy and autoscaler."""
    return f"{name}-{ENCODER}"


def encoder_service_address(name: str, namespace: str) -> str:
    """``HOST:PORT`` of the encoders' headless Service (the front end's ``--encoder-service``:
    every A record is one ready encoder pod)."""
    return f"{encoder_name(name)}.{namespace}.svc:{ENCODER_PORT}"


def child_labels(name: str) -> dict[str, str]:
    """Labels on every child object and pod: the selector plus component and manager."""
    return {**selector_labels(name), LABEL_COMPONENT: COMPONENT, LABEL_MANAGED_BY: MANAGED_BY}


# --- The REST client (was kube.py) ----------------------------------------------------------------

_PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "Ingress": "ingresses",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "Pod": "pods",
    "Event": "events",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "ScaledObject": "scaledobjects",  # keda.sh
    "PodMonitor": "podmonitors",  # monitoring.coreos.com
    "NetworkPolicy": "networkpolicies",  # networking.k8s.io
    # spec.routing (routing.py): the endpoint picker's objects, the internal token (created
    # only, never read) and the InferencePool
    "ServiceAccount": "serviceaccounts",
    "RoleBinding": "rolebindings",  # rbac.authorization.k8s.io
    "Secret": "secrets",
    "InferencePool": "inferencepools",  # inference.networking.k8s.io
    KIND: PLURAL,
}
JSON = "application/json"
APPLY = "application/apply-patch+yaml"


class KubeError(Exception):
    """An API call failed; ``status`` is the HTTP code (0 when the server did not answer)."""

    def __init__(self, status: int, message: str, reason: str = "") -> None:
        super().__init__(f"HTTP {status} {reason}: {message}".strip())
        self.status = status
        self.reason = reason
        self.message = message


def object_path(api_version: str, kind: str, namespace: str | None, name: str | None = None) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if kind not in _PLURALS:
        raise KubeError(0, f"the operator does not manage {kind} objects")
    path = (
        f"{base}/namespaces/{namespace}/{_PLURALS[kind]}"
        if namespace
        else f"{base}/{_PLURALS[kind]}"
    )
    return f"{path}/{name}" if name else path


def service_path(namespace: str, name: str | None = None) -> str:
    return object_path(API_VERSION, KIND, namespace, name)


logger = logging.getLogger(__name__)


def _applied_time(obj: Mapping[str, Any]) -> str | None:
    """When this field manager's applied fields of ``obj`` last changed (managedFields)."""
    for entry in obj.get("metadata", {}).get("managedFields") or ():
        if entry.get("manager") == FIELD_MANAGER and entry.get("operation") == "Apply":
            return str(entry.get("time"))
    return None


def _just_now(stamp: str | None, seconds: float = 10.0) -> bool:
    """``stamp`` (an RFC 3339 managedFields time) is within ``seconds`` of this clock: the
    first apply this client makes changed the object (an operator that starts and updates)."""
    if not stamp:
        return False
    try:
        when = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return False
    return abs((datetime.datetime.now(datetime.UTC) - when).total_seconds()) <= seconds


class Kube:
    """REST calls with one client configuration; thread-safe (urllib3 pool)."""

    def __init__(self, configuration: kubernetes.client.Configuration, timeout: float = 30.0):
        self.configuration = configuration
        self.api = kubernetes.client.ApiClient(configuration)
        self.timeout = timeout
        self.instance = socket.gethostname()
        self._applied: dict[str, str | None] = {}  # path -> _applied_time after our last apply
        self._applied_lock = threading.Lock()

    @classmethod
    def from_kubeconfig(cls, kubeconfig: Path | str | None = None) -> Kube:
        """Configured from ``kubeconfig``, else in-cluster, else ``$KUBECONFIG``."""
        cfg = kubernetes.client.Configuration()
        if kubeconfig is not None:
            kubernetes.config.load_kube_config(str(kubeconfig), client_configuration=cfg)
            return cls(cfg)
        try:
            kubernetes.config.load_incluster_config(client_configuration=cfg)
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(client_configuration=cfg)
        return cls(cfg)

    def close(self) -> None:
        self.api.close()

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: Mapping[str, str] | None = None,
        content_type: str = JSON,
    ) -> dict[str, Any]:
        return self._exchange(method, path, body, query, content_type)[1]

    def _exchange(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: Mapping[str, str] | None = None,
        content_type: str = JSON,
    ) -> tuple[int, dict[str, Any]]:
        """:meth:`request` with the HTTP status of the answer (201: created)."""
        headers = {"Content-Type": content_type, "Accept": JSON}
        try:
            _, url, headers, payload, _ = self.api.param_serialize(
                method,
                path,
                query_params=list((query or {}).items()) or None,
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            resp = self.api.call_api(
                method, url, header_params=headers, body=payload, _request_timeout=self.timeout
            )
            data = resp.read()
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise KubeError(0, f"{method} {path}: {exc}", "NoResponse") from exc
        except kubernetes.client.ApiException as exc:
            raise KubeError(int(exc.status or 0), str(exc.reason or exc), "ClientError") from exc
        try:
            parsed: dict[str, Any] = json.loads(data) if data else {}
        except ValueError:  # e.g. a plain-text "404 page not found" for an unserved API group
            parsed = {"message": data.decode(errors="replace")[:200]}
        if not 200 <= resp.status <= 299:
            raise KubeError(
                resp.status, str(parsed.get("message") or data), parsed.get("reason", "")
            )
        return int(resp.status), parsed

    def get(self, path: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", path)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply ``manifest`` (create or update) as the operator's field manager."""
        meta = manifest["metadata"]
        path = object_path(
            manifest["apiVersion"], manifest["kind"], meta.get("namespace"), meta["name"]
        )
        query = {"fieldManager": FIELD_MANAGER, "force": "true", "fieldValidation": "Strict"}
        code, obj = self._exchange("PATCH", path, dict(manifest), query, APPLY)
        stamp = _applied_time(obj)
        with self._applied_lock:
            seen = path in self._applied
            before = self._applied.get(path)
            self._applied[path] = stamp
        what = f"{manifest['kind']} {meta.get('namespace') or ''}/{meta['name']}".replace(" /", " ")
        if code == 201:
            logger.info("created %s", what)
        elif stamp != before if seen else _just_now(stamp):
            logger.info("updated %s", what)
        else:  # unchanged, or first seen by this client (its last change is not news)
            logger.debug("applied %s (unchanged)", what)
        return obj

    def create(self, manifest: Mapping[str, Any]) -> bool:
        """Create ``manifest`` (POST); False when it exists already (409), which is left as it
        is: the way to write an object the operator may create but never read (a Secret)."""
        meta = manifest["metadata"]
        path = object_path(manifest["apiVersion"], manifest["kind"], meta.get("namespace"))
        try:
            self.request("POST", path, dict(manifest), {"fieldManager": FIELD_MANAGER})
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise
        logger.info("created %s %s/%s", manifest["kind"], meta.get("namespace"), meta["name"])
        return True

    def list(self, path: str, label_selector: str) -> list[dict[str, Any]]:
        """The items of a collection ``path`` matching ``label_selector``."""
        items: list[dict[str, Any]] = (
            self.request("GET", path, query={"labelSelector": label_selector}).get("items") or []
        )
        return items

    def delete(self, path: str) -> None:
        """Delete in the background (dependents follow); an object already gone is no error."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        try:
            self.request("DELETE", path, body)
        except KubeError as exc:
            if exc.status != 404:
                raise
            return
        with self._applied_lock:
            self._applied.pop(path, None)
        logger.info("deleted %s", path)

    def replace_status(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """PUT the status subresource; ``metadata.resourceVersion`` makes it conditional."""
        meta = obj["metadata"]
        return self.request(
            "PUT", service_path(meta["namespace"], meta["name"]) + "/status", dict(obj)
        )

    def post_event(self, involved: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        """Record a core/v1 Event on ``involved`` (``kind``: Normal or Warning)."""
        meta = involved["metadata"]
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": involved.get("apiVersion", API_VERSION),
                "kind": involved.get("kind", KIND),
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "reason": reason,
            "message": message[:1024],
            "type": kind,
            "source": {"component": REPORTING_COMPONENT},
            "reportingComponent": REPORTING_COMPONENT,
            "reportingInstance": self.instance,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        self.request("POST", object_path("v1", "Event", meta["namespace"]), event)
