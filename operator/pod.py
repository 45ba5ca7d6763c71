"""The inference pod template: containers ``frontend`` (P0) and ``engine`` (P1).

Invariants:
- Both containers get the same engine <-> front end addresses (``resource.py``) and the same
  ``/dev/shm`` volume: an ``emptyDir`` with medium Memory whose ``sizeLimit`` is the shm store
  plus headroom. tmpfs pages are charged to the writer's memory cgroup and the front end writes
  the store, so the volume size is added to the front end's memory request and limit.
- GPUs are requested only on ``engine`` (as limits; requests equal limits for extended
  resources). CPU has requests and no limit (no throttling); memory request == limit.
- Probes: a startup probe on ``/health`` whose budget is ``probes.startupTimeoutSeconds``
  (slow downloads and model loads), readiness on ``/ready``, liveness on ``/health``.
- Non-root, no privilege escalation, all capabilities dropped, read-only root filesystem;
  writable paths are emptyDirs (/tmp, the model cache).
- The engine stays up while the front end drains (its preStop pause is longer), so in-flight
  requests finish before P1 exits.
"""

from __future__ import annotations

import json
import math
from typing import Any

from mmis.operator import quantity
from mmis.operator import resource as r
from mmis.operator.spec import ServiceSpec

CACHE_DIR = "/var/cache/mmis"
STARTUP_PERIOD = 10


def address_args() -> list[str]:
    """The ZMQ addresses, identical on both containers."""
    return [
        "--engine-input-address",
        r.ENGINE_INPUT_ADDRESS,
        "--engine-output-address",
        r.ENGINE_OUTPUT_ADDRESS,
    ]


def _cache_args(spec: ServiceSpec) -> list[str]:
    return [
        "--mm-cache-type",
        spec.cache.type,
        "--mm-cache-gb",
        quantity.gib(spec.cache.size_bytes),
    ]


def frontend_args(spec: ServiceSpec) -> list[str]:
    args = ["frontend", "--model", spec.model.name, "--host", "0.0.0.0", "--port", str(r.HTTP_PORT)]
    args += _cache_args(spec) + address_args()
    if spec.api_key_secret:
        args += ["--api-key", "$(MMIS_API_KEY)"]  # expanded by the kubelet from the Secret
    if spec.allowed_local_media_path:
        args += ["--allowed-local-media-path", spec.allowed_local_media_path]
    if spec.otlp_endpoint:
        args += ["--otlp-traces-endpoint", spec.otlp_endpoint]
    return args


def engine_args(spec: ServiceSpec) -> list[str]:
    args = ["engine", "--model", spec.model.name, *_cache_args(spec), *address_args()]
    if spec.cache.engine_size_bytes is not None:
        args += ["--engine-mm-cache-gb", quantity.gib(spec.cache.engine_size_bytes)]
    if spec.fault_evict_rate is not None:
        args += ["--fault-evict-rate", f"{spec.fault_evict_rate:g}"]
    if spec.otlp_endpoint:
        args += ["--otlp-traces-endpoint", spec.otlp_endpoint]
    return args


def common_env(spec: ServiceSpec, name: str) -> list[dict[str, Any]]:
    """Settings without a CLI flag travel as ``MMIS_<SECTION>_<FIELD>`` (the config layer)."""
    env: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "MMIS_CACHE_SHM_GB", "value": quantity.gib(spec.cache.shm_store_bytes)},
        {"name": "MMIS_MODEL_SERVED_NAME", "value": spec.model.served_name},
        {"name": "MMIS_MODEL_PROCESSOR_KWARGS", "value": json.dumps(spec.model.processor_kwargs)},
        {"name": "MMIS_ENGINE_MAX_NUM_SEQS", "value": str(spec.max_num_seqs)},
        {"name": "MMIS_ENGINE_MAX_NUM_BATCHED_TOKENS", "value": str(spec.max_num_batched_tokens)},
        {"name": "OTEL_SERVICE_NAME", "value": f"mmis-{name}"},
        {"name": "OTEL_TRACES_SAMPLER", "value": "parentbased_traceidratio"},
        {"name": "OTEL_TRACES_SAMPLER_ARG", "value": f"{spec.sampling_ratio:g}"},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    if spec.model.revision:
        env.append({"name": "MMIS_MODEL_REVISION", "value": spec.model.revision})
    if spec.kv_cache_bytes is not None:
        env.append({"name": "MMIS_ENGINE_KV_CACHE_GB", "value": quantity.gib(spec.kv_cache_bytes)})
    return env


def _probe(path: str, period: int, failures: int, timeout: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": r.HTTP_PORT_NAME},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def _security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _mounts() -> list[dict[str, Any]]:
    return [
        {"name": r.SHM_VOLUME, "mountPath": r.SHM_MOUNT},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "model-cache", "mountPath": CACHE_DIR},
    ]


def _pre_stop(seconds: int) -> dict[str, Any]:
    return {"preStop": {"exec": {"command": ["sleep", str(seconds)]}}}


def frontend_container(spec: ServiceSpec, name: str) -> dict[str, Any]:
    memory = quantity.format_bytes(spec.frontend_memory_bytes + spec.cache.shm_volume_bytes)
    env = common_env(spec, name)
    if spec.api_key_secret:
        secret, key = spec.api_key_secret
        env.append(
            {
                "name": "MMIS_API_KEY",
                "valueFrom": {"secretKeyRef": {"name": secret, "key": key}},
            }
        )
    container: dict[str, Any] = {
        "name": r.FRONTEND,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["mmis"],
        "args": frontend_args(spec),
        "ports": [{"name": r.HTTP_PORT_NAME, "containerPort": r.HTTP_PORT, "protocol": "TCP"}],
        "env": env,
        "resources": {
            "requests": {"cpu": spec.frontend_cpu, "memory": memory},
            "limits": {"memory": memory},
        },
        "startupProbe": _probe(
            "/health", STARTUP_PERIOD, math.ceil(spec.startup_timeout_seconds / STARTUP_PERIOD), 5
        ),
        "readinessProbe": _probe("/ready", 5, 3, 3),
        "livenessProbe": _probe("/health", 10, 3, 5),
        "securityContext": _security(),
        "volumeMounts": _mounts(),
    }
    if spec.drain_seconds:
        container["lifecycle"] = _pre_stop(spec.drain_seconds)
    return container


def engine_container(spec: ServiceSpec, name: str) -> dict[str, Any]:
    memory = quantity.format_bytes(spec.engine_memory_bytes)
    limits: dict[str, Any] = {"memory": memory}
    if spec.gpus:
        limits[r.GPU_RESOURCE] = str(spec.gpus)
    container: dict[str, Any] = {
        "name": r.ENGINE,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["mmis"],
        "args": engine_args(spec),
        "env": common_env(spec, name),
        "resources": {"requests": {"cpu": spec.engine_cpu, "memory": memory}, "limits": limits},
        "securityContext": _security(),
        "volumeMounts": _mounts(),
    }
    if spec.drain_seconds:
        container["lifecycle"] = _pre_stop(spec.drain_seconds + 5)
    return container


def pod_spec(spec: ServiceSpec, name: str) -> dict[str, Any]:
    """The generated pod spec, before the user's ``podTemplate`` override."""
    scheduling = spec.scheduling
    tolerations = list(scheduling.get("tolerations") or [])
    if spec.gpus:
        tolerations.append({"key": r.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    body: dict[str, Any] = {
        "containers": [frontend_container(spec, name), engine_container(spec, name)],
        "volumes": [
            {
                "name": r.SHM_VOLUME,
                "emptyDir": {
                    "medium": "Memory",
                    "sizeLimit": quantity.format_bytes(spec.cache.shm_volume_bytes),
                },
            },
            {"name": "tmp", "emptyDir": {}},
            {"name": "model-cache", "emptyDir": {}},
        ],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": r.RUN_AS_USER,
            "runAsGroup": r.RUN_AS_USER,
            "fsGroup": r.RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": spec.drain_seconds + 35,
        "enableServiceLinks": False,
    }
    if tolerations:
        body["tolerations"] = tolerations
    if scheduling.get("nodeSelector"):
        body["nodeSelector"] = dict(scheduling["nodeSelector"])
    if scheduling.get("affinity"):
        body["affinity"] = dict(scheduling["affinity"])
    if scheduling.get("priorityClassName"):
        body["priorityClassName"] = scheduling["priorityClassName"]
    return body
