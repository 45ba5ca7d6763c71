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
- Settings reach the server as flags its parsers know (``tests/contract`` parses them with
  the real ``mmis frontend`` / ``mmis engine`` parsers); the only ``MMIS_*`` variable is
  ``MMIS_FRONTEND_API_KEY`` from the Secret, so the key never appears in the pod spec.
  A server setting the spec leaves unset is not passed: the server's one default applies.
  ``model.revision`` goes to both containers (``--revision``); ``model.processorKwargs`` to
  the front end only (``--processor-kwargs``, compact JSON): P1 never runs the processor.
- The engine stays up while the front end drains (its preStop pause is longer), so in-flight
  requests finish before P1 exits.
"""

from __future__ import annotations

import json
import math
from typing import Any

from mmis_operator import quantity
from mmis_operator import resource as r
from mmis_operator.spec import ServiceSpec

CACHE_DIR = "/var/cache/mmis"
STARTUP_PERIOD = 10
API_KEY_ENV = "MMIS_FRONTEND_API_KEY"  # FrontendConfig.api_key via the frontend section


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


def frontend_args(spec: ServiceSpec) -> list[str]:
    """``mmis frontend`` flags; every one exists in ``mmis.entrypoints.frontend``."""
    args = ["frontend", "--model", spec.model.name, "--served-model-name", spec.model.served_name]
    args += [*revision_args(spec), *processor_kwargs_args(spec)]
    args += ["--host", "0.0.0.0", "--port", str(r.HTTP_PORT), "--ops-port", str(r.OPS_PORT)]
    args += address_args()
    shadow = quantity.gib(spec.cache.size_bytes)
    args += ["--mm-cache-type", spec.cache.type, "--mm-cache-gb", shadow]
    if spec.cache.type == "shm":
        args += [*_shm_args(spec), "--shm-gb", quantity.gib(spec.cache.shm_store_bytes)]
    if spec.cache.drift_window_seconds is not None:
        args += ["--drift-window-s", str(spec.cache.drift_window_seconds)]
    if spec.allowed_local_media_path:
        args += ["--allowed-local-media-path", spec.allowed_local_media_path]
    if spec.otlp_endpoint:
        args += ["--otlp-traces-endpoint", spec.otlp_endpoint]
    return args


def engine_args(spec: ServiceSpec) -> list[str]:
    """``mmis engine`` flags; every one exists in ``mmis.entrypoints.engine``."""
    receiver = spec.cache.size_bytes
    if spec.cache.engine_size_bytes is not None:
        receiver = spec.cache.engine_size_bytes
    args = ["engine", "--model", spec.model.name, *revision_args(spec), *address_args()]
    args += ["--mm-cache-type", spec.cache.type, "--engine-mm-cache-gb", quantity.gib(receiver)]
    args += _shm_args(spec)
    if spec.max_num_seqs is not None:
        args += ["--max-num-seqs", str(spec.max_num_seqs)]
    if spec.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(spec.max_num_batched_tokens)]
    if spec.kv_cache_bytes is not None:
        args += ["--kv-cache-gb", quantity.gib(spec.kv_cache_bytes)]
    if spec.fault_evict_rate is not None:
        args += ["--fault-evict-rate", f"{spec.fault_evict_rate:g}"]
    if spec.otlp_endpoint:
        args += ["--otlp-traces-endpoint", spec.otlp_endpoint]
    return args


def common_env(spec: ServiceSpec, name: str) -> list[dict[str, Any]]:
    """Environment both containers share. Settings travel as flags; no ``MMIS_*`` here, so
    the pod never carries a variable the server does not read (``tests/contract``)."""
    return [
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "OTEL_SERVICE_NAME", "value": f"mmis-{name}"},
        {"name": "OTEL_TRACES_SAMPLER", "value": "parentbased_traceidratio"},
        {"name": "OTEL_TRACES_SAMPLER_ARG", "value": f"{spec.sampling_ratio:g}"},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]


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
        "args": frontend_args(spec),
        "ports": [
            {"name": r.HTTP_PORT_NAME, "containerPort": r.HTTP_PORT, "protocol": "TCP"},
            {"name": r.OPS_PORT_NAME, "containerPort": r.OPS_PORT, "protocol": "TCP"},
        ],
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
