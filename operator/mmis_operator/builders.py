"""The objects one MMInferenceService owns, built from its parsed spec: a Deployment (its pod
template: containers ``frontend`` (P0) and ``engine`` (P1), and for ``model.id`` the init
container ``model-download``), a Service and, optionally, an Ingress, a PodDisruptionBudget, the
model cache's PersistentVolumeClaim, an autoscaler (an ``autoscaling/v2``
HorizontalPodAutoscaler or a KEDA ``ScaledObject``), a prometheus-operator ``PodMonitor`` (and
the plain-Prometheus ``prometheus.io/*`` pod annotations) and the routing objects (an
InferencePool and its endpoint picker: :mod:`mmis_operator.routing`, which this module calls).

Owns (each a section below): the children and their metadata, the inference pod, the
autoscalers, the PodMonitor.

Invariants:
- Pure functions: (owner metadata, parsed spec) in, manifest dicts out; no API calls. Which
  autoscaler kind to render, and whether the cluster serves the PodMonitor CRD (API discovery)
  or the operator's settings (``MMIS_OPERATOR_AUTOSCALER``, ``MMIS_OPERATOR_POD_MONITORS=off``)
  turn one off, is the reconciler's business (:mod:`mmis_operator.reconciler`), never decided
  here.
- Every child carries a controller owner reference to the MMInferenceService (garbage
  collection deletes children with their owner) and the labels of ``kube.child_labels``.
- The pod selector is ``kube.selector_labels(name)``; the ``podTemplate`` override may add
  labels but can never change or drop the selector labels (a Deployment's selector is
  immutable, and the Service and scale subresource rely on it).
- Children are named after the owner, so reconciling twice yields identical manifests.
- The Ingress routes only ``INGRESS_ROUTES`` (the OpenAI API and /health) under its path; the
  Service exposes only the ``http`` port, never ``ops``.
- The rollout strategy comes from ``spec.rollout`` (default surge 0, unavailable 1: a rollout
  never waits for a GPU the node does not have); the PDB from ``spec.disruption``.
- With ``spec.autoscaling`` on, the autoscaler owns the resource's ``spec.replicas`` and the
  Deployment runs that number clamped into [min, max]. Both autoscaler kinds target the
  MMInferenceService's own scale subresource (``scaleTargetRef`` kind MMInferenceService; the
  CRD's ``labelSelectorPath`` is ``.status.selector``), never the Deployment, so nobody fights
  over the Deployment's replicas. Manifests applied by people should then leave
  ``spec.replicas`` out.
- Scraping: the PodMonitor and the scrape annotations point at the front end's operations port
  (``kube.OPS_PORT``, named ``ops``, path /metrics, no API key), which no Service or Ingress
  exposes: scraping is pod to pod. The PodMonitor selects exactly the resource's pods
  (``kube.selector_labels``) and adds the ``mmis.dev/service`` pod label to every series (as
  ``mmis_dev_service``).

The inference pod:
- Both containers get the same engine <-> front end addresses (``kube.py``) and the same
  ``/dev/shm`` volume: an ``emptyDir`` with medium Memory whose ``sizeLimit`` is the shm store
  plus headroom. tmpfs pages are charged to the writer's memory cgroup and the front end writes
  the store, so the volume size is added to the front end's memory request and limit.
- GPUs are requested only on ``engine`` (as limits; requests equal limits for extended
  resources). CPU has requests and no limit (no throttling); memory request == limit.
- Probes: a startup probe on ``/health`` whose budget is ``probes.startupTimeoutSeconds``
  (slow downloads and model loads), readiness on ``/ready``, liveness on ``/health`` with a
  short grace period of its own (a hung process is not drained).
- N P0 processes (``spec.frontend.apiServers``, ``--api-servers N``, no flag when N is 1):
  one supervisor binds the API and ops ports for all N, so ports, probe paths, the Service and
  the PodMonitor are those of one process; a probe reaches whichever process accepts it. The
  container's CPU/memory requests are the spec's (``spec.parse_frontend``: N times one
  process's defaults when unset); the /dev/shm volume is not multiplied (``--shm-gb`` is the
  total of all N). The startup budget does not depend on N: the N children start together
  and the pod's start is bounded by the download and the engine's model load, which N does
  not change. SIGTERM drains the N in parallel, each within the same
  ``--graceful-shutdown-s``; the supervisor lets a draining child run
  :data:`API_SERVERS_STOP_MARGIN_SECONDS` longer before killing it, and holds the drain lock
  until the last has exited, so with N > 1 the engine's wait (and the grace period) is that
  much longer (:func:`engine_wait_seconds`).
- Non-root, no privilege escalation, all capabilities dropped, read-only root filesystem, on
  every container (Pod Security ``restricted``); writable paths are volumes (/tmp, the model
  cache). No service-account token is mounted (``automountServiceAccountToken: false``): the
  server never calls the API server. The front end gets ``NVIDIA_VISIBLE_DEVICES=void``: it
  needs no GPU, so the NVIDIA runtime exposes none to it.
- Model storage: the ``model-cache`` volume is an emptyDir whose ``sizeLimit`` is
  ``model.storage.size`` (the same ephemeral-storage request on the engine and the download,
  so the scheduler counts it), or a claim (``model.storage``: created by the operator or
  existing). ``model.id`` is downloaded once per pod by the init container (the only
  container with ``HF_TOKEN``, from ``model.tokenSecretRef``); P0 and P1 then read the same
  ``HF_HOME`` with ``HF_HUB_OFFLINE=1``, so neither downloads again nor needs the token.
- Settings reach the server as flags its parsers know (``tests/contract`` parses them with
  the real ``mmis frontend`` / ``mmis engine`` parsers); the only ``MMIS_*`` variables are
  secrets, read from Secrets (``secretKeyRef``) so no key appears in the pod spec:
  ``MMIS_FRONTEND_API_KEY`` and, with routing, the internal token
  (``MMIS_FRONTEND_INTERNAL_TOKEN``, ``MMIS_ENGINE_EVENTS_TOKEN``).
  A server setting the spec leaves unset is not passed: the server's one default applies.
  ``model.revision`` goes to both containers (``--revision``); ``model.processorKwargs`` to
  the front end only (``--processor-kwargs``, compact JSON): P1 never runs the processor.
- With ``spec.routing`` the engine also publishes its cache events for the endpoint picker
  (``routing.engine_args``, named ports ``kv-events``, ``kv-replay``, ``mm-events``,
  ``mm-replay``); without it the pod is exactly what it was before routing existed.
- Termination in order (docs/SECURITY.md): the front end holds a shared lock on
  :data:`DRAIN_LOCK` (``--drain-lock``, on the pod's shared /dev/shm) while it lives; the
  engine's preStop is ``mmis wait-frontend`` on that lock, so P1 gets SIGTERM only after every
  P0 of the pod has exited (or after :func:`engine_wait_seconds`: the front end's preStop
  pause, its graceful shutdown and 5 s), and the pod's grace period is that wait plus
  :data:`ENGINE_STOP_SECONDS` for the engine's own stop. No in-flight request loses its engine.
- With ``spec.routing`` the front end, the engine and the picker read the internal token from
  the Secret ``NAME-internal`` (``routing.token_env``: ``secretKeyRef``, never a value).
- With ``spec.adapters`` (present, whatever its list) the engine gets ``--enable-lora`` and
  P0 the internal token (an optional reference when neither routing nor encoders need the
  Secret), and P0 downloads ``hf://`` adapters itself: it runs without ``HF_HUB_OFFLINE`` (a
  cached model still loads when the hub is unreachable) and with ``model.tokenSecretRef``'s
  ``HF_TOKEN``; the engine stays offline. Each ``pvc://`` claim of the list is a read-only
  volume mounted at ``spec.ADAPTER_CLAIMS_DIR/CLAIM`` in both containers. Nothing else of the
  list reaches the pod: the operator pushes it (:mod:`mmis_operator.adapters`).
- With ``spec.encoder`` the front end also gets ``--encoder-service
  NAME-encoder.NAMESPACE.svc:PORT`` (:func:`encoder_service`, the encoders' headless Service:
  :mod:`mmis_operator.encoder` builds the encoder objects) and ``MMIS_ENCODER_TOKEN`` from the
  internal token's Secret, both last, so without it the pod is exactly what it was before.
- NetworkPolicy ``NAME`` (:func:`network_policy`) selects the inference pods: the API port
  from anywhere; the ops port from the picker, the operator and the scrapers; the engine's
  event ports (with routing) from the picker only; nothing else (the kubelet's probes are node
  traffic, always allowed).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from mmis_operator import kube as r  # the resource's names (kube.py's first section)
from mmis_operator import routing
from mmis_operator.spec import (
    ADAPTER_CLAIMS_DIR,
    AutoscalingSpec,
    MonitoringSpec,
    ServiceSpec,
    adapter_claims,
    format_bytes,
    gib,
    merge,
)

# --- The children of one MMInferenceService (was children.py) -------------------------------------

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


def pod_template(spec: ServiceSpec, name: str, namespace: str | None = None) -> dict[str, Any]:
    """The inference pods' template; ``namespace`` names the encoders' Service (with
    ``spec.encoder``; None: the Service's short name, resolved in the pod's namespace)."""
    generated = {
        "metadata": {
            "labels": r.child_labels(name),
            "annotations": {
                "kubectl.kubernetes.io/default-container": r.FRONTEND,
                **scrape_annotations(spec.monitoring),
            },
        },
        "spec": pod_spec(spec, name, namespace),
    }
    merged = merge(generated, spec.pod_template) if spec.pod_template else generated
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
            "template": pod_template(spec, name, owner["metadata"].get("namespace")),
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
        "resources": {"requests": {"storage": format_bytes(storage.size_bytes)}},
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
        return scaled_object(owner, meta, spec.autoscaling)
    return horizontal_pod_autoscaler(owner, meta, spec.autoscaling)


def pod_monitor(owner: Mapping[str, Any], spec: ServiceSpec) -> dict[str, Any] | None:
    """The PodMonitor, or None when ``spec.monitoring.podMonitor`` is false."""
    if not spec.monitoring.pod_monitor:
        return None
    meta = _metadata(owner, owner["metadata"]["name"])
    return pod_monitor_manifest(owner, meta, spec.monitoring)


def routing_objects(
    owner: Mapping[str, Any],
    spec: ServiceSpec,
    cluster_role: str,
    scrapers: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The InferencePool and its endpoint picker's objects, or none without ``spec.routing``;
    ``cluster_role`` is the picker's ClusterRole to bind, ``scrapers`` who may scrape it when
    NetworkPolicies are rendered (None: none)."""
    if spec.routing is None:
        return []
    meta = _metadata(owner, owner["metadata"]["name"])
    return routing.manifests(owner, meta, spec.routing, cluster_role, scrapers)


def token_secret(owner: Mapping[str, Any], token: str) -> dict[str, Any]:
    """The internal token's Secret ``NAME-internal`` (``routing.token_secret``), owned."""
    return routing.token_secret(_metadata(owner, owner["metadata"]["name"]), token)


def network_policy(
    owner: Mapping[str, Any],
    spec: ServiceSpec,
    scrapers: Mapping[str, Any],
    operator_peer: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The inference pods' NetworkPolicy ``NAME`` (Ingress only):

    - ``http`` (8000), the API: from anywhere (the Service, the Ingress, the gateway);
    - ``ops`` (8001): from the picker pods of this resource (with routing: load metrics and
      ``/internal/block_keys``), the operator's pods (``operator_peer``: the coherence probe;
      None when the operator does not know its namespace and labels) and ``scrapers``;
    - with routing, the engine's event ports (``routing.EVENT_PORTS``): from the picker only;
    - the engine's health port (8002) admits nothing: the kubelet's probes are node traffic,
      which NetworkPolicy always allows.
    """
    name = owner["metadata"]["name"]
    picker = {"podSelector": {"matchLabels": routing.picker_selector(name)}}
    ops_from: list[dict[str, Any]] = []
    if spec.routing is not None:
        ops_from.append(picker)
    if operator_peer is not None:
        ops_from.append(dict(operator_peer))
    ops_from.append(dict(scrapers))
    ingress: list[dict[str, Any]] = [
        {"ports": [_tcp(r.HTTP_PORT)]},
        {"ports": [_tcp(r.OPS_PORT)], "from": ops_from},
    ]
    if spec.routing is not None:
        events = routing.EVENT_PORTS
        ports = (events.kv, events.kv_replay, events.mm, events.mm_replay)
        ingress.append({"ports": [_tcp(p) for p in ports], "from": [picker]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(owner, name),
        "spec": {
            "podSelector": {"matchLabels": r.selector_labels(name)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def _tcp(port: int) -> dict[str, Any]:
    return {"protocol": "TCP", "port": port}


def endpoint(owner: Mapping[str, Any], spec: ServiceSpec) -> str:
    """Where clients reach the OpenAI API: the Ingress URL if any, else the in-cluster URL."""
    meta = owner["metadata"]
    cfg = spec.ingress
    if cfg.get("enabled"):
        scheme = "https" if cfg.get("tlsSecretName") else "http"
        path = str(cfg["path"]).rstrip("/")
        return f"{scheme}://{cfg['host']}{path}/v1"
    return f"http://{meta['name']}.{meta['namespace']}.svc:{spec.service_port}/v1"


# --- The inference pod template (was pod.py) ------------------------------------------------------

CACHE_DIR = "/var/cache/mmis"
MODEL_CACHE_VOLUME = "model-cache"
DOWNLOAD = "model-download"  # the init container that fills the model cache
STARTUP_PERIOD = 10
HUNG_GRACE_SECONDS = 5  # a liveness failure's grace period (the probe's own, not the pod's)
API_KEY_ENV = "MMIS_FRONTEND_API_KEY"  # FrontendConfig.api_key via the frontend section
# termination in order: P0 holds a shared lock on this file while it lives (--drain-lock), P1's
# preStop waits until no P0 holds it (mmis wait-frontend)
DRAIN_LOCK = f"{r.SHM_MOUNT}/frontend-drain.lock"
# how long SIGTERM lets P0 finish in-flight requests: the front end's --graceful-shutdown-s
# default, which the operator does not set (tests/contract/test_pod_contract.py checks it)
FRONTEND_GRACEFUL_SECONDS = 30
ENGINE_STOP_SECONDS = 15  # P1's own stop after SIGTERM (the grace period's last part)
# with --api-servers N > 1: how much longer than --graceful-shutdown-s the supervisor lets a
# draining child run before it kills it (mmis.entrypoints.api_servers.STOP_MARGIN_S;
# tests/contract/test_pod_contract.py checks it)
API_SERVERS_STOP_MARGIN_SECONDS = 10
TOKEN_ENV = "HF_TOKEN"
ADAPTER_VOLUME_PREFIX = "lora-"  # + the claim of a pvc:// adapter source
# P0's and the encoder's token (epd: MMIS_ENCODER_TOKEN), read from the internal token's Secret
ENCODER_TOKEN_ENV = "MMIS_ENCODER_TOKEN"
# snapshot_download of the weights, config, tokenizer and processor files of one revision
# into HF_HOME (huggingface_hub ships with transformers in the server image); formats the
# server never loads are left out
DOWNLOAD_SCRIPT = (
    "import sys\n"
    "from huggingface_hub import snapshot_download\n"
    "repo, revision = sys.argv[1], (sys.argv[2] or None)\n"
    "path = snapshot_download(repo, revision=revision, ignore_patterns=["
    "'*.h5', '*.msgpack', '*.onnx', '*.onnx_data', '*.tflite', '*.ot', '*.gguf', 'onnx/*'])\n"
    "print('model ready at', path, flush=True)\n"
)


def address_args() -> list[str]:
    """The ZMQ addresses, identical on both containers."""
    return [
        "--engine-input-address",
        r.ENGINE_INPUT_ADDRESS,
        "--engine-output-address",
        r.ENGINE_OUTPUT_ADDRESS,
    ]


def revision_args(spec: ServiceSpec) -> list[str]:
    """The model revision, identical on both containers (none: the hub's default branch)."""
    return ["--revision", spec.model.revision] if spec.model.revision else []


def processor_kwargs_args(spec: ServiceSpec) -> list[str]:
    """The processor's call kwargs as one JSON object (front end only)."""
    kwargs = spec.model.processor_kwargs
    if not kwargs:
        return []
    return ["--processor-kwargs", json.dumps(dict(kwargs), sort_keys=True, separators=(",", ":"))]


def _shm_args(spec: ServiceSpec) -> list[str]:
    """Both sides name the store's directory; only the writer (P0) sizes it."""
    return ["--shm-dir", r.SHM_MOUNT] if spec.cache.type == "shm" else []


def frontend_args(spec: ServiceSpec, encoder_service: str | None = None) -> list[str]:
    """``mmis frontend`` flags; every one exists in ``mmis.entrypoints.frontend``.
    ``encoder_service``: the encoders' headless Service as ``HOST:PORT`` (with
    ``spec.encoder``; its flag comes last, so without it the flags are as before)."""
    args = ["frontend", "--model", spec.model.name, "--served-model-name", spec.model.served_name]
    args += [*revision_args(spec), *processor_kwargs_args(spec)]
    args += ["--host", "0.0.0.0", "--port", str(r.HTTP_PORT), "--ops-port", str(r.OPS_PORT)]
    args += address_args()
    args += ["--drain-lock", DRAIN_LOCK]
    if spec.api_servers > 1:  # one process: no flag, the server's default
        args += ["--api-servers", str(spec.api_servers)]
    shadow = gib(spec.cache.size_bytes)
    args += ["--mm-cache-type", spec.cache.type, "--mm-cache-gb", shadow]
    if spec.cache.type == "shm":
        args += [*_shm_args(spec), "--shm-gb", gib(spec.cache.shm_store_bytes)]
    if spec.cache.drift_window_seconds is not None:
        args += ["--drift-window-s", str(spec.cache.drift_window_seconds)]
    if spec.allowed_local_media_path:
        args += ["--allowed-local-media-path", spec.allowed_local_media_path]
    if spec.otlp_endpoint:
        args += ["--otlp-traces-endpoint", spec.otlp_endpoint]
    if spec.encoder is not None and encoder_service:
        args += ["--encoder-service", encoder_service]
    return [*args, *spec.frontend_flags]  # spec.frontend's serving settings (spec.FRONTEND_FLAGS)


def engine_args(spec: ServiceSpec) -> list[str]:
    """``mmis engine`` flags; every one exists in ``mmis.entrypoints.engine``."""
    receiver = spec.cache.size_bytes
    if spec.cache.engine_size_bytes is not None:
        receiver = spec.cache.engine_size_bytes
    args = ["engine", "--model", spec.model.name, *revision_args(spec), *address_args()]
    args += ["--health-port", str(r.ENGINE_HEALTH_PORT)]
    args += ["--mm-cache-type", spec.cache.type, "--engine-mm-cache-gb", gib(receiver)]
    args += _shm_args(spec)
    if spec.gpus > 1:  # every GPU the container gets runs a slice of each layer
        args += ["--tensor-parallel-size", str(spec.gpus)]
    if spec.max_num_seqs is not None:
        args += ["--max-num-seqs", str(spec.max_num_seqs)]
    if spec.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(spec.max_num_batched_tokens)]
    if spec.kv_cache_bytes is not None:
        args += ["--kv-cache-gb", gib(spec.kv_cache_bytes)]
    if spec.fault_evict_rate is not None:
        args += ["--fault-evict-rate", f"{spec.fault_evict_rate:g}"]
    if spec.otlp_endpoint:
        args += ["--otlp-traces-endpoint", spec.otlp_endpoint]
    if spec.routing is not None:  # the endpoint picker subscribes to its cache events
        args += routing.engine_args()
    if spec.adapters is not None:  # the list itself reaches the pods at run time, never here
        args += ["--enable-lora"]
    return [*args, *spec.engine_flags]  # spec.engine's serving settings (spec.ENGINE_FLAGS)


def common_env(spec: ServiceSpec, name: str) -> list[dict[str, Any]]:
    """Environment both containers share. Settings travel as flags; no ``MMIS_*`` here, so
    the pod never carries a variable the server does not read (``tests/contract``)."""
    env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"}]
    if not spec.model.is_path:  # the init container downloaded it; never a second download
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    return [
        *env,
        {"name": "OTEL_SERVICE_NAME", "value": f"mmis-{name}"},
        {"name": "OTEL_TRACES_SAMPLER", "value": "parentbased_traceidratio"},
        {"name": "OTEL_TRACES_SAMPLER_ARG", "value": f"{spec.sampling_ratio:g}"},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]


def _probe(
    path: str, period: int, failures: int, timeout: int, port: str = r.HTTP_PORT_NAME
) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def _liveness(port: str) -> dict[str, Any]:
    """A hung process has nothing to drain: its restart waits
    :data:`HUNG_GRACE_SECONDS`, not the pod's drain-sized grace period."""
    return {
        **_probe("/health", 10, 3, 5, port),
        "terminationGracePeriodSeconds": HUNG_GRACE_SECONDS,
    }


def _security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _mounts(spec: ServiceSpec) -> list[dict[str, Any]]:
    return [
        {"name": r.SHM_VOLUME, "mountPath": r.SHM_MOUNT},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": MODEL_CACHE_VOLUME, "mountPath": CACHE_DIR},
        *(
            {"name": adapter_volume(c), "mountPath": f"{ADAPTER_CLAIMS_DIR}/{c}", "readOnly": True}
            for c in adapter_claims(spec.adapters)
        ),
    ]


def adapter_volume(claim: str) -> str:
    """The volume of a ``pvc://CLAIM/...`` adapter source (mounted read-only at
    ``ADAPTER_CLAIMS_DIR/CLAIM`` in both containers)."""
    return f"{ADAPTER_VOLUME_PREFIX}{claim}"


def adapter_token_env(name: str) -> dict[str, Any]:
    """P0's internal token for ``spec.adapters`` alone (no routing, no encoder): the same
    Secret, ``optional``, so a pod starts whether or not the operator could create it (no
    internal key: P0 then has no token and refuses ``/internal/*``, which the adapters' status
    says)."""
    env = routing.token_env(name, routing.FRONTEND_TOKEN_ENV)
    env["valueFrom"]["secretKeyRef"]["optional"] = True
    return env


def created_claim_name(name: str) -> str:
    """The name of the model cache claim the operator creates for resource ``name``."""
    return f"{name}-{MODEL_CACHE_VOLUME}"


def claim_name(spec: ServiceSpec, name: str) -> str | None:
    """The model cache's claim: the existing one, the one the operator creates, or None."""
    storage = spec.model.storage
    if storage.type != "PersistentVolumeClaim":
        return None
    return storage.claim_name or created_claim_name(name)


def model_cache_volume(spec: ServiceSpec, name: str) -> dict[str, Any]:
    claim = claim_name(spec, name)
    if claim is not None:
        return {"name": MODEL_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": claim}}
    size = format_bytes(spec.model.storage.size_bytes)
    return {"name": MODEL_CACHE_VOLUME, "emptyDir": {"sizeLimit": size}}


def download_container(spec: ServiceSpec, name: str) -> dict[str, Any] | None:
    """The init container that downloads ``model.id`` once per pod into the shared cache
    (None for ``model.path``); the only container that gets ``HF_TOKEN``."""
    if spec.model.is_path:
        return None
    env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"}]
    if spec.model.token_secret:
        secret, key = spec.model.token_secret
        env.append({"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}})
    container: dict[str, Any] = {
        "name": DOWNLOAD,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["python3", "-c", DOWNLOAD_SCRIPT],
        "args": [spec.model.name, spec.model.revision or ""],
        "env": env,
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "1Gi"}},
        "securityContext": _security(),
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": MODEL_CACHE_VOLUME, "mountPath": CACHE_DIR},
        ],
    }
    if spec.model.storage.type == "EmptyDir":
        container["resources"]["requests"]["ephemeral-storage"] = format_bytes(
            spec.model.storage.size_bytes
        )
    return container


def encoder_service(name: str, namespace: str | None) -> str:
    """The front end's ``--encoder-service`` for resource ``name``: the encoders' headless
    Service, ``NAME-encoder.NAMESPACE.svc:PORT`` (``NAME-encoder:PORT`` without a namespace)."""
    if namespace:
        return r.encoder_service_address(name, namespace)
    return f"{r.encoder_name(name)}:{r.ENCODER_PORT}"


def _pre_stop(seconds: int) -> dict[str, Any]:
    return {"preStop": {"exec": {"command": ["sleep", str(seconds)]}}}


def engine_wait_seconds(spec: ServiceSpec) -> int:
    """The longest the engine's preStop waits for the pod's front ends to exit: the front
    end's preStop pause (endpoint removal), its graceful shutdown, and 5 s of slack; with
    several P0 processes also the supervisor's margin before it kills a draining child."""
    margin = API_SERVERS_STOP_MARGIN_SECONDS if spec.api_servers > 1 else 0
    return spec.drain_seconds + FRONTEND_GRACEFUL_SECONDS + margin + 5


def _wait_frontend(spec: ServiceSpec) -> dict[str, Any]:
    """The engine's preStop: wait until no front end of the pod holds :data:`DRAIN_LOCK`."""
    command = ["mmis", "wait-frontend", "--lock", DRAIN_LOCK]
    command += ["--timeout-s", str(engine_wait_seconds(spec))]
    return {"preStop": {"exec": {"command": command}}}


def frontend_container(
    spec: ServiceSpec, name: str, namespace: str | None = None
) -> dict[str, Any]:
    memory = format_bytes(spec.frontend_memory_bytes + spec.cache.shm_volume_bytes)
    # the front end needs no GPU: the NVIDIA runtime then mounts none into it
    env = [*common_env(spec, name), {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    if spec.adapters is not None:  # P0 downloads hf:// adapters (the engine stays offline)
        env = [e for e in env if e["name"] != "HF_HUB_OFFLINE"]
        if spec.model.token_secret:
            secret, key = spec.model.token_secret
            ref = {"secretKeyRef": {"name": secret, "key": key}}
            env.append({"name": TOKEN_ENV, "valueFrom": ref})
    if spec.routing is not None:  # /internal/* answers only the picker's bearer token
        env.append(routing.token_env(name, routing.FRONTEND_TOKEN_ENV))
    elif spec.adapters is not None:  # ... and the operator's, which pushes spec.adapters
        env.append(adapter_token_env(name))
    if spec.encoder is not None:  # the encoders admit only the internal token (ZMQ PLAIN)
        env.append(routing.token_env(name, ENCODER_TOKEN_ENV))
    if spec.api_key_secret:
        secret, key = spec.api_key_secret
        # read by the server's config layer; never a flag (it would show in the pod spec)
        env.append(
            {
                "name": API_KEY_ENV,
                "valueFrom": {"secretKeyRef": {"name": secret, "key": key}},
            }
        )
    container: dict[str, Any] = {
        "name": r.FRONTEND,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["mmis"],
        "args": frontend_args(spec, encoder_service(name, namespace)),
        "ports": [
            {"name": r.HTTP_PORT_NAME, "containerPort": r.HTTP_PORT, "protocol": "TCP"},
            {"name": r.OPS_PORT_NAME, "containerPort": r.OPS_PORT, "protocol": "TCP"},
        ],
        "env": env,
        "resources": {
            "requests": {"cpu": spec.frontend_cpu, "memory": memory},
            "limits": {"memory": memory},
        },
        # one probe per container: the front end's liveness is about this process only
        # (/health); /ready also needs the engine link, so the pod is ready when both are
        "startupProbe": _probe(
            "/health", STARTUP_PERIOD, math.ceil(spec.startup_timeout_seconds / STARTUP_PERIOD), 5
        ),
        "readinessProbe": _probe("/ready", 5, 3, 3),
        "livenessProbe": _liveness(r.HTTP_PORT_NAME),
        "securityContext": _security(),
        "volumeMounts": _mounts(spec),
    }
    if spec.drain_seconds:
        container["lifecycle"] = _pre_stop(spec.drain_seconds)
    return container


def engine_container(spec: ServiceSpec, name: str) -> dict[str, Any]:
    memory = format_bytes(spec.engine_memory_bytes)
    limits: dict[str, Any] = {"memory": memory}
    requests: dict[str, Any] = {"cpu": spec.engine_cpu, "memory": memory}
    if spec.gpus:
        limits[r.GPU_RESOURCE] = str(spec.gpus)
    if spec.model.storage.type == "EmptyDir":  # the emptyDir model cache is charged here
        requests["ephemeral-storage"] = format_bytes(spec.model.storage.size_bytes)
    return {
        "name": r.ENGINE,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["mmis"],
        "args": engine_args(spec),
        "ports": [
            {
                "name": r.ENGINE_HEALTH_PORT_NAME,
                "containerPort": r.ENGINE_HEALTH_PORT,
                "protocol": "TCP",
            },
            *(routing.engine_ports() if spec.routing is not None else []),
        ],
        "env": [
            *common_env(spec, name),
            # the event sockets admit only the picker (ZMQ PLAIN with the internal token)
            *([routing.token_env(name, routing.ENGINE_TOKEN_ENV)] if spec.routing else []),
        ],
        "resources": {"requests": requests, "limits": limits},
        # the engine answers its own probe (mmis engine --health-port) once its model is
        # loaded: a hung or stopped engine is restarted, not the front end
        "startupProbe": _probe(
            "/health",
            STARTUP_PERIOD,
            math.ceil(spec.startup_timeout_seconds / STARTUP_PERIOD),
            5,
            r.ENGINE_HEALTH_PORT_NAME,
        ),
        "readinessProbe": _probe("/health", 5, 3, 3, r.ENGINE_HEALTH_PORT_NAME),
        "livenessProbe": _liveness(r.ENGINE_HEALTH_PORT_NAME),
        "securityContext": _security(),
        "volumeMounts": _mounts(spec),
        # SIGTERM only once every front end of the pod has drained and exited
        "lifecycle": _wait_frontend(spec),
    }


def pod_spec(spec: ServiceSpec, name: str, namespace: str | None = None) -> dict[str, Any]:
    """The generated pod spec, before the user's ``podTemplate`` override."""
    scheduling = spec.scheduling
    tolerations = list(scheduling.get("tolerations") or [])
    if spec.gpus:
        tolerations.append({"key": r.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    body: dict[str, Any] = {
        "containers": [
            frontend_container(spec, name, namespace),
            engine_container(spec, name),
        ],
        "volumes": [
            {
                "name": r.SHM_VOLUME,
                "emptyDir": {
                    "medium": "Memory",
                    "sizeLimit": format_bytes(spec.cache.shm_volume_bytes),
                },
            },
            {"name": "tmp", "emptyDir": {}},
            model_cache_volume(spec, name),
            *(
                {
                    "name": adapter_volume(c),
                    "persistentVolumeClaim": {"claimName": c, "readOnly": True},
                }
                for c in adapter_claims(spec.adapters)
            ),
        ],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": r.RUN_AS_USER,
            "runAsGroup": r.RUN_AS_USER,
            "fsGroup": r.RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": engine_wait_seconds(spec) + ENGINE_STOP_SECONDS,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # the server never calls the API server
    }
    download = download_container(spec, name)
    if download is not None:
        body["initContainers"] = [download]
    if tolerations:
        body["tolerations"] = tolerations
    if scheduling.get("nodeSelector"):
        body["nodeSelector"] = dict(scheduling["nodeSelector"])
    if scheduling.get("affinity"):
        body["affinity"] = dict(scheduling["affinity"])
    if scheduling.get("priorityClassName"):
        body["priorityClassName"] = scheduling["priorityClassName"]
    return body


# --- Autoscalers: HPA or KEDA ScaledObject (was the building half of autoscaling.py) --------------

HPA_API_VERSION = "autoscaling/v2"
KEDA_API_VERSION = "keda.sh/v1alpha1"


def quantity(value: float) -> str:
    """A Kubernetes quantity for ``value``: whole numbers as such, else milli-units."""
    if float(value).is_integer():
        return str(int(value))
    return f"{round(value * 1000)}m"


def _threshold(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _scale_target(owner: Mapping[str, Any]) -> dict[str, str]:
    return {"apiVersion": r.API_VERSION, "kind": r.KIND, "name": owner["metadata"]["name"]}


def _behavior(auto: AutoscalingSpec) -> dict[str, Any]:
    return {
        "scaleUp": {"stabilizationWindowSeconds": auto.scale_up_window_seconds},
        "scaleDown": {"stabilizationWindowSeconds": auto.scale_down_window_seconds},
    }


def horizontal_pod_autoscaler(
    owner: Mapping[str, Any], metadata: Mapping[str, Any], auto: AutoscalingSpec
) -> dict[str, Any]:
    """The HPA on the resource's scale subresource, a Pods metric (a custom-metrics adapter,
    e.g. prometheus-adapter, must serve ``auto.metric`` for the pods)."""
    return {
        "apiVersion": HPA_API_VERSION,
        "kind": "HorizontalPodAutoscaler",
        "metadata": dict(metadata),
        "spec": {
            "scaleTargetRef": _scale_target(owner),
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": auto.metric},
                        "target": {"type": "AverageValue", "averageValue": quantity(auto.target)},
                    },
                }
            ],
            "behavior": _behavior(auto),
        },
    }


def prometheus_query(owner: Mapping[str, Any], metric: str) -> str:
    """The sum of ``metric`` over this resource's pods (Deployment pod names: NAME-HASH-ID,
    so another resource whose name starts with NAME- never matches)."""
    meta = owner["metadata"]
    pods = f"{meta['name']}-[a-z0-9]+-[a-z0-9]+"
    return f'sum({metric}{{namespace="{meta["namespace"]}",pod=~"{pods}"}})'


def scaled_object(
    owner: Mapping[str, Any], metadata: Mapping[str, Any], auto: AutoscalingSpec
) -> dict[str, Any]:
    """The KEDA ScaledObject: a prometheus trigger whose threshold is the per-pod average
    (metricType AverageValue); KEDA creates and owns the HPA itself."""
    return {
        "apiVersion": KEDA_API_VERSION,
        "kind": "ScaledObject",
        "metadata": dict(metadata),
        "spec": {
            "scaleTargetRef": _scale_target(owner),
            "minReplicaCount": auto.min_replicas,
            "maxReplicaCount": auto.max_replicas,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(auto)}},
            "triggers": [
                {
                    "type": "prometheus",
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": auto.prometheus_address,
                        "query": prometheus_query(owner, auto.metric),
                        "threshold": _threshold(auto.target),
                    },
                }
            ],
        },
    }


# --- PodMonitor and scrape annotations (was the building half of monitoring.py) -------------------

POD_MONITOR_API_VERSION = "monitoring.coreos.com/v1"
METRICS_PATH = "/metrics"


def scrape_annotations(monitoring: MonitoringSpec) -> dict[str, str]:
    """The plain-Prometheus pod annotations (the kubernetes_sd convention), or none."""
    if not monitoring.scrape_annotations:
        return {}
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(r.OPS_PORT),
        "prometheus.io/path": METRICS_PATH,
    }


def pod_monitor_manifest(
    owner: Mapping[str, Any], metadata: Mapping[str, Any], monitoring: MonitoringSpec
) -> dict[str, Any]:
    """The PodMonitor of one resource's pods (scraped on ``ops``)."""
    name = owner["metadata"]["name"]
    return {
        "apiVersion": POD_MONITOR_API_VERSION,
        "kind": "PodMonitor",
        "metadata": dict(metadata),
        "spec": {
            "selector": {"matchLabels": r.selector_labels(name)},
            "podTargetLabels": [r.LABEL_SERVICE],
            "podMetricsEndpoints": [
                {"port": r.OPS_PORT_NAME, "path": METRICS_PATH, "interval": monitoring.interval}
            ],
        },
    }
