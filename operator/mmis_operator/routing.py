"""``spec.routing``: cache-aware routing (docs/ROUTING.md). A Gateway API Inference Extension
``InferencePool`` (``inference.networking.k8s.io/v1``) selects the resource's pods, and an
endpoint picker (``mmis-epp``, ``router/``) scores them for each request; a gateway that
supports InferencePool (Istio, kgateway, GKE Gateway) asks the picker where to send it.

Owns (each a section below): the picker's configuration, the one owner of the text
``mmis-epp`` reads (used by the operator's routing objects and by the routing tests and
benchmarks, so what is tested is what is deployed), and the pure builders of the routing
objects (the internal token's Secret and the picker's NetworkPolicy included).
``spec.routing`` itself is parsed by :mod:`mmis_operator.spec`. Kept apart from
:mod:`mmis_operator.builders` (the pod and the other children, which call in here): together
they would pass 1,100 lines, and nothing here but ``engine_args`` / ``engine_ports`` /
``token_env`` reaches the inference pod.

Invariants:
- Pure: (owner metadata, parsed ``spec.routing``, the operator's settings) in, manifests out.
  Whether the cluster serves the InferencePool API, and whether the operator was installed
  with routing (a picker ClusterRole to bind), is the reconciler's business
  (:mod:`mmis_operator.reconciler`); without either nothing here is applied (a picker without
  a pool has nothing to pick for).
- The pool selects exactly the inference pods (``kube.selector_labels``) on the front end's
  ``http`` port; the picker's own pods never carry those labels, nor ``mmis.dev/service``, so
  neither the Service, the pool, the status' pod list nor the operator's Deployment watcher
  ever takes them for inference pods.
- The picker's configuration and the engines' event flags come from one owner (:class:`EventPorts`,
  :data:`EVENT_PORTS`): the event ports are the engine container's ``--kv-events-endpoint`` /
  ``--kv-events-replay-endpoint`` / ``--mm-events-endpoint`` / ``--mm-events-replay-endpoint``
  (:func:`engine_event_args`) and the picker's ``mmis-cache-scorer`` parameters, so the ports
  the engines publish on are the ones the picker subscribes to. The front end's ops port
  (``kube.OPS_PORT``) serves its metrics and ``POST /internal/block_keys``.
- The metrics the framework scrapes are mmis's model-server-protocol metrics
  (``server/mmis/telemetry/catalog.py``: the gauges ``mmis:num_requests_waiting``,
  ``mmis:num_requests_running``, ``mmis:kv_cache_usage_perc``, and ``mmis:lora_requests_info``,
  the LoRA adapters each front end's engine holds), read from the front end's operations port.
- The profile composes the cache scorer with the framework's queue, KV-utilisation and
  LoRA-affinity scorers; a request whose keys or events are missing scores 0 on the cache
  scorer for every pod, so load alone decides and the request never fails for lack of cache
  data. A request for a LoRA adapter goes to a pod that holds it whenever one does
  (:func:`lora_weight`); a base-model request scores the same on every pod there.
- The picker pod meets Pod Security ``restricted``. Its rights are the chart's ClusterRole
  (``--picker-cluster-role``, :data:`PICKER_RULES`: read pods, InferencePools,
  InferenceObjectives and InferenceModelRewrites; leases and events for leader election),
  bound in the resource's namespace only (a RoleBinding ``NAME-epp``); the operator creates no
  Role, so it never needs to hold what it grants: the chart lets it ``bind`` that one
  ClusterRole (``resourceNames``) and nothing else. Every object is owned by the resource
  (controller owner reference), so garbage collection removes them with it.
- The internal token (docs/SECURITY.md): the Secret ``NAME-internal`` (key ``token``) is built
  here from a token the reconciler draws; the operator only ever creates it (never reads,
  lists, changes or deletes a Secret), and the front end, the engine and the picker read it
  through ``secretKeyRef`` env (:data:`FRONTEND_TOKEN_ENV`, :data:`ENGINE_TOKEN_ENV`,
  :data:`PICKER_TOKEN_ENV`): the value never appears in a manifest the operator applies.
- The picker's configuration is its ``--config-text`` argument (no ConfigMap): a change of it
  changes the pod template, so the picker restarts with it (it reads it once, at start).
- The pool's ``endpointPickerRef.failureMode`` is ``FailOpen``: a picker that is down leaves
  the gateway balancing over the pool's pods by itself (docs/ROUTING.md).
- The picker's NetworkPolicy (:func:`network_policy`, when the operator renders policies)
  admits gRPC from any pod of the cluster (the gateway), metrics from the scrapers, and
  nothing else but the kubelet's probes (node traffic, always allowed).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from mmis_operator import kube as r  # the resource's names (kube.py's first section)
from mmis_operator.spec import CACHE_WEIGHT, RoutingSpec

# --- The endpoint picker's configuration (was picker_config.py) -----------------------------------

CACHE_SCORER = "mmis-cache-scorer"
LORA_SCORER = "lora-affinity-scorer"  # the framework's (GIE v1.5.0 scorer/loraaffinity)
# the framework's scorers beside the cache scorer that load decides by, each weighing 1
LOAD_SCORERS = ("queue-scorer", "kv-cache-utilization-scorer")
ENGINE_NAME = "mmis"  # the framework's engine label for our metric names
METRICS = {
    "queuedRequestsSpec": "mmis:num_requests_waiting",
    "runningRequestsSpec": "mmis:num_requests_running",
    "kvUsageSpec": "mmis:kv_cache_usage_perc",
    "loraSpec": "mmis:lora_requests_info",  # server/mmis/telemetry/lora_info.py
}


def lora_weight(cache_weight: int) -> int:
    """The LoRA-affinity scorer's weight: one more than every other scorer's weight together.

    Each scorer's score lies in [0, 1] and the picker takes the highest weighted sum. P0's
    ``mmis:lora_requests_info`` gives ``max_lora`` = the adapters it holds, so the framework's
    scorer gives 1 to a pod holding the request's adapter and 0 to every other (none has "room
    for one more", its 0.8: mmis loads adapters through the load API only). A holder's sum is
    then at least this weight, a non-holder's at most ``cache_weight`` + 1 + 1 (a full cache
    match on an idle, empty pod): the holder wins by at least 1, whatever the cache and the
    load say, and among holders the cache and load scorers decide as without LoRA. A request
    for the base model (or an adapter no pod holds) scores 0 on every pod, so it changes
    nothing there.
    """
    return cache_weight + len(LOAD_SCORERS) + 1


@dataclasses.dataclass(frozen=True)
class EventPorts:
    """Where a pod's engine publishes its cache events (ZMQ, vLLM's framing)."""

    kv: int = 5557
    kv_replay: int = 5558
    mm: int = 5559
    mm_replay: int = 5560


def engine_event_args(ports: EventPorts, host: str = "*") -> list[str]:
    """The engine flags that publish both streams on ``host`` (``*``: every interface)."""
    return [
        "--kv-events-endpoint", f"tcp://{host}:{ports.kv}",
        "--kv-events-replay-endpoint", f"tcp://{host}:{ports.kv_replay}",
        "--mm-events-endpoint", f"tcp://{host}:{ports.mm}",
        "--mm-events-replay-endpoint", f"tcp://{host}:{ports.mm_replay}",
    ]  # fmt: skip


def picker_config(
    ops_port: int,
    ports: EventPorts | None = None,
    *,
    cache_weight: int = CACHE_WEIGHT,
    keys_timeout_ms: int = 300,
    silence_seconds: float = 10.0,
) -> dict[str, Any]:
    """The ``EndpointPickerConfig`` (GIE v1.5.0's schema) as a dict; :func:`render` for text.

    ``ops_port`` is the front end's operations port: its ``/metrics`` and its
    ``POST /internal/block_keys``. ``silence_seconds``: a pod whose replay socket has not
    answered for that long is scored as holding nothing until it answers again. The
    LoRA-affinity scorer weighs :func:`lora_weight` (``cache_weight`` + 3): a pod holding a
    request's adapter always wins over one that does not.
    """
    ports = ports or EventPorts()
    scorer_params = {
        "kvEventsPort": ports.kv,
        "kvReplayPort": ports.kv_replay,
        "mmEventsPort": ports.mm,
        "mmReplayPort": ports.mm_replay,
        "keysPort": ops_port,
        "keysTimeoutMs": keys_timeout_ms,
        "silenceSeconds": silence_seconds,
    }
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": CACHE_SCORER, "parameters": scorer_params},
            *({"type": scorer} for scorer in LOAD_SCORERS),
            {"type": LORA_SCORER},
            {"type": "max-score-picker"},
            {"type": "openai-parser"},
            {
                "type": "metrics-data-source",
                "parameters": {"scheme": "http", "path": "/metrics"},
            },
            {
                "type": "core-metrics-extractor",
                "parameters": {
                    "defaultEngine": ENGINE_NAME,
                    "engineConfigs": [{"name": ENGINE_NAME, **METRICS}],
                },
            },
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": CACHE_SCORER, "weight": cache_weight},
                    *({"pluginRef": scorer, "weight": 1} for scorer in LOAD_SCORERS),
                    {"pluginRef": LORA_SCORER, "weight": lora_weight(cache_weight)},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
        "parser": {"pluginRef": "openai-parser"},
    }


def render(config: dict[str, Any]) -> str:
    """The config as the picker's ``--config-text`` (JSON is YAML)."""
    return json.dumps(config, indent=1, sort_keys=False)


# --- The InferencePool and the endpoint picker's objects (was routing.py) -------------------------

POOL_GROUP = "inference.networking.k8s.io"
POOL_API_VERSION = f"{POOL_GROUP}/v1"
POOL_KIND = "InferencePool"
OBJECTIVE_GROUP = "inference.networking.x-k8s.io"  # InferenceObjective, InferenceModelRewrite
RBAC_GROUP = "rbac.authorization.k8s.io"
RBAC_API_VERSION = f"{RBAC_GROUP}/v1"
POLICY_API_VERSION = "networking.k8s.io/v1"
PICKER = "epp"  # the picker's container, and the suffix of its objects' names
GRPC_PORT = 9002  # ext_proc, what the gateway calls
HEALTH_PORT = 9003  # gRPC health (the probes)
METRICS_PORT = 9090
# the gateway keeps balancing over the pool's pods by itself while the picker is down
FAILURE_MODE = "FailOpen"
RUN_AS_USER = 65532  # distroless "nonroot"
# as the inference extension's reference EPP: about the longest grace period of a pool's pods
GRACE_SECONDS = 130
EVENT_PORTS = EventPorts()
_READ = ["get", "list", "watch"]

# The internal token (docs/SECURITY.md): one Secret per resource with routing
TOKEN_SECRET_SUFFIX = "internal"
TOKEN_KEY = "token"
FRONTEND_TOKEN_ENV = "MMIS_FRONTEND_INTERNAL_TOKEN"  # P0's --internal-token
ENGINE_TOKEN_ENV = "MMIS_ENGINE_EVENTS_TOKEN"  # P1's --events-token
PICKER_TOKEN_ENV = "MMIS_INTERNAL_TOKEN"  # mmis-epp: ZMQ PLAIN and the block_keys bearer

# What the picker may do in its namespace (the inference extension's EPP Role). The chart's
# ClusterRole <fullname>-picker holds exactly these (tests/security/test_rbac.py); the operator
# binds it per resource and never holds them itself.
PICKER_RULES: tuple[dict[str, Any], ...] = (
    {"apiGroups": [""], "resources": ["pods"], "verbs": _READ},
    {"apiGroups": [POOL_GROUP], "resources": ["inferencepools"], "verbs": _READ},
    {
        "apiGroups": [OBJECTIVE_GROUP],
        "resources": ["inferenceobjectives", "inferencemodelrewrites"],
        "verbs": _READ,
    },
    # leader election, with more than one replica
    {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "verbs": [*_READ, "create", "update", "patch", "delete"],
    },
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
)


def engine_args() -> list[str]:
    """The engine flags that publish its cache events where the picker subscribes."""
    return engine_event_args(EVENT_PORTS)


def engine_ports() -> list[dict[str, Any]]:
    """The engine container's event ports, named (a name is at most 15 characters)."""
    named = {
        "kv-events": EVENT_PORTS.kv,
        "kv-replay": EVENT_PORTS.kv_replay,
        "mm-events": EVENT_PORTS.mm,
        "mm-replay": EVENT_PORTS.mm_replay,
    }
    return [{"name": k, "containerPort": v, "protocol": "TCP"} for k, v in named.items()]


def picker_name(name: str) -> str:
    """The name of the picker's Deployment, Service, ServiceAccount, RoleBinding and
    NetworkPolicy."""
    return f"{name}-{PICKER}"


def picker_selector(name: str) -> dict[str, str]:
    """The picker pods' labels: never the inference pods' selector, no ``mmis.dev/service``."""
    return {r.LABEL_NAME: "mmis-epp", r.LABEL_INSTANCE: name}


def token_secret_name(name: str) -> str:
    """The Secret holding resource ``name``'s internal token."""
    return f"{name}-{TOKEN_SECRET_SUFFIX}"


def token_env(name: str, variable: str) -> dict[str, Any]:
    """The env var ``variable`` read from resource ``name``'s internal token (never a value)."""
    ref = {"name": token_secret_name(name), "key": TOKEN_KEY}
    return {"name": variable, "valueFrom": {"secretKeyRef": ref}}


def token_secret(owner_metadata: Mapping[str, Any], token: str) -> dict[str, Any]:
    """The Secret ``NAME-internal`` with ``token`` (the reconciler draws it:
    ``secrets.token_hex(32)``); ``owner_metadata`` is the owner's child metadata."""
    meta = {**owner_metadata, "name": token_secret_name(owner_metadata["name"])}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "stringData": {TOKEN_KEY: token},
    }


def _labels(name: str) -> dict[str, str]:
    return {
        **picker_selector(name),
        r.LABEL_COMPONENT: "endpoint-picker",
        r.LABEL_MANAGED_BY: r.MANAGED_BY,
    }


def config_text(routing: RoutingSpec) -> str:
    """The picker's ``EndpointPickerConfig`` (its ``--config-text``)."""
    config = picker_config(
        ops_port=r.OPS_PORT, ports=EVENT_PORTS, cache_weight=routing.cache_weight
    )
    return render(config)


def picker_args(pool: str, namespace: str, routing: RoutingSpec) -> list[str]:
    """``mmis-epp`` flags (the inference extension v1.5.0 runner's)."""
    args = [
        "--pool-name", pool,
        "--pool-namespace", namespace,
        "--pool-group", POOL_GROUP,
        "--config-text", config_text(routing),
        "--grpc-port", str(GRPC_PORT),
        "--grpc-health-port", str(HEALTH_PORT),
        "--metrics-port", str(METRICS_PORT),
        "--model-server-metrics-port", str(r.OPS_PORT),
        # its /metrics is reached pod to pod like the front end's ops port; checking scrapers'
        # tokens would need cluster-wide TokenReview rights no namespaced owner can hold
        "--metrics-endpoint-auth=false",
        "--tracing=false",  # no collector is configured for it
    ]  # fmt: skip
    if routing.replicas > 1:
        args.append("--ha-enable-leader-election")
    return args


def _probe(routing: RoutingSpec, kind: str, **timing: int) -> dict[str, Any]:
    # one replica answers as "inference-extension"; with leader election the leader alone is
    # ready ("readiness"), every replica is live ("liveness")
    service = kind if routing.replicas > 1 else "inference-extension"
    return {"grpc": {"port": HEALTH_PORT, "service": service}, **timing}


def _pod_template(name: str, namespace: str, routing: RoutingSpec) -> dict[str, Any]:
    container = {
        "name": PICKER,
        "image": routing.image,
        "args": picker_args(name, namespace, routing),
        "ports": [
            {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
            {"name": "grpc-health", "containerPort": HEALTH_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        "env": [
            {"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            token_env(name, PICKER_TOKEN_ENV),
        ],
        "resources": {
            "requests": {"cpu": "500m", "memory": "1Gi"},
            "limits": {"memory": "1Gi"},
        },
        "readinessProbe": _probe(routing, "readiness", periodSeconds=2),
        "livenessProbe": _probe(routing, "liveness", initialDelaySeconds=5, periodSeconds=10),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    return {
        "metadata": {"labels": _labels(name)},
        "spec": {
            "serviceAccountName": picker_name(name),
            "containers": [container],
            "volumes": [{"name": "tmp", "emptyDir": {}}],
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": RUN_AS_USER,
                "runAsGroup": RUN_AS_USER,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "terminationGracePeriodSeconds": GRACE_SECONDS,
            "enableServiceLinks": False,
        },
    }


def _tcp(*ports: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": port} for port in ports]


def network_policy(
    metadata: Mapping[str, Any], name: str, scrapers: Mapping[str, Any]
) -> dict[str, Any]:
    """The picker pods' NetworkPolicy ``NAME-epp``: ext_proc gRPC from any pod of the cluster
    (the gateway), metrics from ``scrapers`` (a NetworkPolicyPeer). The health port admits no
    one: the kubelet's probes are node traffic, which NetworkPolicy always allows."""
    anywhere_in_cluster: dict[str, Any] = {"namespaceSelector": {}}
    return {
        "apiVersion": POLICY_API_VERSION,
        "kind": "NetworkPolicy",
        "metadata": dict(metadata),
        "spec": {
            "podSelector": {"matchLabels": picker_selector(name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": _tcp(GRPC_PORT), "from": [anywhere_in_cluster]},
                {"ports": _tcp(METRICS_PORT), "from": [dict(scrapers)]},
            ],
        },
    }


def manifests(
    owner: Mapping[str, Any],
    metadata: Mapping[str, Any],
    routing: RoutingSpec,
    cluster_role: str,
    scrapers: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The routing objects, in apply order (what the picker needs before the picker, the pool
    last). ``metadata`` is the owner's child metadata (name, namespace, labels, owner ref);
    ``cluster_role`` the chart's picker ClusterRole, bound in the namespace; ``scrapers``,
    when the operator renders NetworkPolicies, who may scrape the picker's metrics (None: no
    policy). The internal token's Secret is not here: it is created once, never applied
    (:func:`token_secret`)."""
    name = owner["metadata"]["name"]
    namespace = metadata["namespace"]
    picker = {**metadata, "name": picker_name(name), "labels": _labels(name)}
    pool = {
        "selector": {"matchLabels": r.selector_labels(name)},
        "targetPorts": [{"number": r.HTTP_PORT}],
        "endpointPickerRef": {
            "name": picker_name(name),
            "port": {"number": GRPC_PORT},
            "failureMode": FAILURE_MODE,
        },
    }
    deployment = {
        "replicas": routing.replicas,
        "selector": {"matchLabels": picker_selector(name)},
        # one active picker: its cache view is per process; the old one goes first
        "strategy": {"type": "Recreate"},
        "revisionHistoryLimit": 5,
        "template": _pod_template(name, namespace, routing),
    }
    ports = [
        {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP"},
        {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
    ]
    subject = {"kind": "ServiceAccount", "name": picker_name(name), "namespace": namespace}
    role_ref = {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": cluster_role}
    policy = [network_policy(picker, name, scrapers)] if scrapers is not None else []
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": picker},
        {
            "apiVersion": RBAC_API_VERSION,
            "kind": "RoleBinding",
            "metadata": picker,
            "roleRef": role_ref,
            "subjects": [subject],
        },
        *policy,
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": picker, "spec": deployment},
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": picker,
            "spec": {"type": "ClusterIP", "selector": picker_selector(name), "ports": ports},
        },
        {
            "apiVersion": POOL_API_VERSION,
            "kind": POOL_KIND,
            "metadata": dict(metadata),
            "spec": pool,
        },
    ]


def object_refs(name: str) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of every routing object of resource ``name`` the operator
    deletes when routing goes, in the order of :func:`manifests` (the NetworkPolicy whether or
    not policies are rendered; not the token's Secret: the operator never deletes a Secret,
    garbage collection does, with the resource)."""
    picker = picker_name(name)
    return [
        ("v1", "ServiceAccount", picker),
        (RBAC_API_VERSION, "RoleBinding", picker),
        (POLICY_API_VERSION, "NetworkPolicy", picker),
        ("apps/v1", "Deployment", picker),
        ("v1", "Service", picker),
        (POOL_API_VERSION, POOL_KIND, name),
    ]
