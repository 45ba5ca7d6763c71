"""``spec.encoder``: the pool's encoder pods (E/PD, issue 46 item 5). ``mmis encoder`` runs the
model's vision tower and projector only, keeps the outputs in its own cache, and the front ends
of this resource's PD pods ask it for an image's encoder output instead of sending P1 the
pixels (docs: /work/helpers/epd.md's flow; a front end that gets no answer sends the pixels as
before, so a pool whose encoders are down still serves).

Owns: the pure builders of the encoder objects, all named ``NAME-encoder``
(:func:`kube.encoder_name`): a Deployment, a headless Service over its pods, a PodMonitor of
their metrics, a NetworkPolicy and, with ``spec.encoder.autoscaling``, an autoscaler (an
``autoscaling/v2`` HorizontalPodAutoscaler or a KEDA ScaledObject) on the encoders' queue
depth. The inference pods' side (``--encoder-service`` and the token on the front end) is
:mod:`mmis_operator.builders`'; ``spec.encoder`` is parsed by :mod:`mmis_operator.spec`.

Invariants:
- Pure: (owner metadata, parsed spec, the operator's settings) in, manifests out. Whether the
  operator may create the token's Secret (installed with ``encoder.enabled``) and which
  autoscaler kind the cluster serves is the reconciler's business.
- Without ``spec.encoder`` nothing here is built and the inference pods are byte for byte what
  they were before the field existed (tests/operator/golden).
- The encoder pods never carry the inference pods' selector labels nor ``mmis.dev/service``
  (:func:`selector`): the resource's Service, PodDisruptionBudget, InferencePool, PodMonitor,
  status pod list and the operator's Deployment/pod watchers never take them for inference
  pods. Every object carries a controller owner reference to the resource (garbage
  collection deletes them with it).
- The encoder reads the model from the same place as the engine: the ``model-cache`` volume
  (an emptyDir filled by the same ``model-download`` init container per pod, or the same
  claim: a claim shared with encoder pods on other nodes needs ReadWriteMany), with the same
  ``--revision`` and no ``--dtype`` (the server's ``auto``, as P1), so the encoder's key
  (model, revision, dtype) equals the one P0 asks for.
- The ROUTER binds every interface (``tcp://0.0.0.0:PORT``), so the encoder requires its
  token: ``MMIS_ENCODER_TOKEN`` from the internal token's Secret ``NAME-internal`` (the one
  routing uses; created once by the reconciler, never read), on the encoder and on every front
  end. The token never appears in a manifest.
- The headless Service (``clusterIP: None``) lists only ready encoder pods: the front end
  re-resolves its name every few seconds and rendezvous-hashes items over the A records.
- The NetworkPolicy admits the encoder port only from this resource's inference pods
  (``kube.selector_labels``) and the health port (``/metrics``) only from the scrapers; the
  kubelet's probes are node traffic, always allowed.
- The autoscaler scales the encoder Deployment itself (not the resource's scale
  subresource: that is the PD pods'); the Deployment then leaves ``replicas`` out of its
  manifest, so the operator's server-side apply never takes the count back from it. The metric
  is :data:`spec.ENCODER_QUEUE` (items waiting in one encoder), a per-pod average.
- ``spec.podTemplate`` is the inference pods' override and does not apply here; the encoder
  pods get ``spec.scheduling`` (node selector, tolerations, affinity, priority), the GPU
  toleration when they request GPUs, and their own override ``spec.encoder.podTemplate``
  (merged by ``spec.merge``'s rules; the container is named ``encoder``), which may add labels
  but never change or drop the selector labels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mmis_operator import builders, routing
from mmis_operator import kube as r  # the resource's names (kube.py's first section)
from mmis_operator.spec import ENCODER_QUEUE, EncoderSpec, ServiceSpec, format_bytes, merge

APP_NAME = "mmis-encoder"  # app.kubernetes.io/name of the encoder pods (never "mmis")
COMPONENT = "encoder"
# what a rollout of the encoders may do: one more first, so the pool keeps an encoder (a front
# end falls back to local encoding meanwhile anyway)
MAX_SURGE = 1
MAX_UNAVAILABLE = 0
GRACE_SECONDS = 30  # an encoder answers its batch and exits; P0 falls back after its timeout


def selector(name: str) -> dict[str, str]:
    """The encoder pods' labels: never the inference pods' selector, no ``mmis.dev/service``."""
    return {r.LABEL_NAME: APP_NAME, r.LABEL_INSTANCE: name}


def labels(name: str) -> dict[str, str]:
    return {**selector(name), r.LABEL_COMPONENT: COMPONENT, r.LABEL_MANAGED_BY: r.MANAGED_BY}


def metadata(owner: Mapping[str, Any]) -> dict[str, Any]:
    """The child metadata of the encoder objects of ``owner`` (name ``NAME-encoder``)."""
    meta = owner.get("metadata") or {}
    if not meta.get("namespace"):
        raise builders.OwnerError("owner metadata lacks namespace")
    return {
        "name": r.encoder_name(meta["name"]),
        "namespace": meta["namespace"],
        "labels": labels(meta["name"]),
        "ownerReferences": [builders.owner_reference(owner)],
    }


def encoder_args(spec: ServiceSpec) -> list[str]:
    """``mmis encoder`` flags (epd.md's CLI): the model as the engine reads it, the ROUTER on
    every interface, the health port (``/health``, ``/metrics``) and, with
    ``spec.telemetry.otlpEndpoint``, the traces' collector."""
    args = ["encoder", "--model", spec.model.name, *builders.revision_args(spec)]
    args += ["--endpoint", f"tcp://0.0.0.0:{r.ENCODER_PORT}"]
    args += ["--health-port", str(r.ENCODER_HEALTH_PORT)]
    if spec.otlp_endpoint:  # an encode span per batch, linked to the requests' traces
        args += ["--otlp-traces-endpoint", spec.otlp_endpoint]
    return args


def _health_probe(period: int, failures: int, timeout: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": r.ENCODER_HEALTH_PORT_NAME},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def _env(spec: ServiceSpec, name: str) -> list[dict[str, Any]]:
    """The inference containers' common env, traced as ``mmis-NAME-encoder``."""
    service = {"name": "OTEL_SERVICE_NAME", "value": f"mmis-{r.encoder_name(name)}"}
    env = builders.common_env(spec, name)
    return [service if var["name"] == service["name"] else var for var in env]


def container(spec: ServiceSpec, enc: EncoderSpec, name: str) -> dict[str, Any]:
    memory = format_bytes(enc.memory_bytes)
    limits: dict[str, Any] = {"memory": memory}
    requests: dict[str, Any] = {"cpu": enc.cpu, "memory": memory}
    if enc.gpus:
        limits[r.GPU_RESOURCE] = str(enc.gpus)
    if spec.model.storage.type == "EmptyDir":  # the emptyDir model cache is charged here
        requests["ephemeral-storage"] = format_bytes(spec.model.storage.size_bytes)
    startup = math.ceil(spec.startup_timeout_seconds / builders.STARTUP_PERIOD)
    return {
        "name": r.ENCODER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["mmis"],
        "args": encoder_args(spec),
        "ports": [
            {"name": r.ENCODER_PORT_NAME, "containerPort": r.ENCODER_PORT, "protocol": "TCP"},
            {
                "name": r.ENCODER_HEALTH_PORT_NAME,
                "containerPort": r.ENCODER_HEALTH_PORT,
                "protocol": "TCP",
            },
        ],
        "env": [
            *_env(spec, name),
            routing.token_env(name, builders.ENCODER_TOKEN_ENV),
        ],
        "resources": {"requests": requests, "limits": limits},
        "startupProbe": _health_probe(builders.STARTUP_PERIOD, startup, 5),
        "readinessProbe": _health_probe(5, 3, 3),
        "livenessProbe": {
            **_health_probe(10, 3, 5),
            "terminationGracePeriodSeconds": builders.HUNG_GRACE_SECONDS,
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": builders.MODEL_CACHE_VOLUME, "mountPath": builders.CACHE_DIR},
        ],
    }


def pod_template(spec: ServiceSpec, enc: EncoderSpec, name: str) -> dict[str, Any]:
    scheduling = spec.scheduling
    tolerations = list(scheduling.get("tolerations") or [])
    if enc.gpus:
        tolerations.append({"key": r.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    body: dict[str, Any] = {
        "containers": [container(spec, enc, name)],
        "volumes": [
            {"name": "tmp", "emptyDir": {}},
            builders.model_cache_volume(spec, name),
        ],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": r.RUN_AS_USER,
            "runAsGroup": r.RUN_AS_USER,
            "fsGroup": r.RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": GRACE_SECONDS,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
    }
    download = builders.download_container(spec, name)
    if download is not None:
        body["initContainers"] = [download]
    if tolerations:
        body["tolerations"] = tolerations
    for key in ("nodeSelector", "affinity"):
        if scheduling.get(key):
            body[key] = dict(scheduling[key])
    if scheduling.get("priorityClassName"):
        body["priorityClassName"] = scheduling["priorityClassName"]
    generated = {"metadata": {"labels": labels(name)}, "spec": body}
    if not enc.pod_template:
        return generated
    merged = merge(generated, enc.pod_template)
    merged.setdefault("metadata", {}).setdefault("labels", {}).update(selector(name))
    return merged


def deployment(owner: Mapping[str, Any], spec: ServiceSpec, enc: EncoderSpec) -> dict[str, Any]:
    """The encoder Deployment; without ``replicas`` when an autoscaler owns the count."""
    name = owner["metadata"]["name"]
    body: dict[str, Any] = {
        "selector": {"matchLabels": selector(name)},
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": MAX_SURGE, "maxUnavailable": MAX_UNAVAILABLE},
        },
        "revisionHistoryLimit": 5,
        "template": pod_template(spec, enc, name),
    }
    if enc.autoscaling is None:
        body = {"replicas": enc.replicas, **body}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(owner),
        "spec": body,
    }


def service(owner: Mapping[str, Any]) -> dict[str, Any]:
    """The headless Service: one A record per ready encoder pod (the front ends' set)."""
    name = owner["metadata"]["name"]
    port = {
        "name": r.ENCODER_PORT_NAME,
        "port": r.ENCODER_PORT,
        "targetPort": r.ENCODER_PORT_NAME,
        "protocol": "TCP",
    }
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner),
        "spec": {"clusterIP": "None", "selector": selector(name), "ports": [port]},
    }


def pod_monitor(owner: Mapping[str, Any], spec: ServiceSpec) -> dict[str, Any]:
    """The encoder pods' PodMonitor (their health port's ``/metrics``); series carry the
    resource's name as ``instance`` (the pods' ``app.kubernetes.io/instance``)."""
    name = owner["metadata"]["name"]
    endpoint = {
        "port": r.ENCODER_HEALTH_PORT_NAME,
        "path": builders.METRICS_PATH,
        "interval": spec.monitoring.interval,
    }
    return {
        "apiVersion": builders.POD_MONITOR_API_VERSION,
        "kind": "PodMonitor",
        "metadata": metadata(owner),
        "spec": {
            "selector": {"matchLabels": selector(name)},
            "podTargetLabels": [r.LABEL_INSTANCE],
            "podMetricsEndpoints": [endpoint],
        },
    }


def network_policy(owner: Mapping[str, Any], scrapers: Mapping[str, Any]) -> dict[str, Any]:
    """The encoder pods' NetworkPolicy ``NAME-encoder`` (Ingress only): the encoder port from
    this resource's inference pods only, the health port (metrics) from ``scrapers``."""
    name = owner["metadata"]["name"]
    pd_pods = {"podSelector": {"matchLabels": r.selector_labels(name)}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(owner),
        "spec": {
            "podSelector": {"matchLabels": selector(name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [{"protocol": "TCP", "port": r.ENCODER_PORT}], "from": [pd_pods]},
                {
                    "ports": [{"protocol": "TCP", "port": r.ENCODER_HEALTH_PORT}],
                    "from": [dict(scrapers)],
                },
            ],
        },
    }


def prometheus_query(owner: Mapping[str, Any]) -> str:
    """The sum of the encoders' queue over this resource's encoder pods (NAME-encoder-HASH-ID)."""
    meta = owner["metadata"]
    pods = f"{r.encoder_name(meta['name'])}-[a-z0-9]+-[a-z0-9]+"
    return f'sum({ENCODER_QUEUE}{{namespace="{meta["namespace"]}",pod=~"{pods}"}})'


def autoscaler(owner: Mapping[str, Any], enc: EncoderSpec, kind: str) -> dict[str, Any] | None:
    """The encoders' autoscaler of ``kind`` (``builders.AUTOSCALER_KINDS``) on the encoder
    Deployment, or None without ``spec.encoder.autoscaling``."""
    if enc.autoscaling is None:
        return None
    meta = metadata(owner)
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": meta["name"]}
    if kind == "ScaledObject":
        manifest = builders.scaled_object(owner, meta, enc.autoscaling)
        manifest["spec"]["triggers"][0]["metadata"]["query"] = prometheus_query(owner)
    else:
        manifest = builders.horizontal_pod_autoscaler(owner, meta, enc.autoscaling)
    manifest["spec"]["scaleTargetRef"] = target
    return manifest


def manifests(
    owner: Mapping[str, Any],
    spec: ServiceSpec,
    autoscaler_kind: str,
    pod_monitors: bool,
    scrapers: Mapping[str, Any] | None,
) -> dict[str, dict[str, Any] | None]:
    """Kind -> the encoder object of that kind (None: must not exist), in apply order, for
    every kind the operator may have applied: ``autoscaler_kind`` is the kind
    ``spec.encoder.autoscaling`` becomes here, ``pod_monitors`` whether a PodMonitor is
    wanted, ``scrapers`` who may scrape the metrics (None: no NetworkPolicy rendered). Without
    ``spec.encoder`` every value is None."""
    enc = spec.encoder
    wanted: dict[str, dict[str, Any] | None] = dict.fromkeys(
        ("NetworkPolicy", "Service", "Deployment", "PodMonitor", *builders.AUTOSCALER_KINDS)
    )
    if enc is None:
        return wanted
    if scrapers is not None:
        wanted["NetworkPolicy"] = network_policy(owner, scrapers)
    wanted["Service"] = service(owner)
    wanted["Deployment"] = deployment(owner, spec, enc)
    if pod_monitors:
        wanted["PodMonitor"] = pod_monitor(owner, spec)
    if enc.autoscaling is not None:
        wanted[autoscaler_kind] = autoscaler(owner, enc, autoscaler_kind)
    return wanted
