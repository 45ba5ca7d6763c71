"""The MMInferenceService spec, parsed into frozen dataclasses with every default applied.

Invariants:
- Defaults and the typed reading of one field are ``spec_fields.py`` (:data:`DEFAULTS`, the
  one home, equal to the CRD's ``default:`` values); ``spec.model`` is ``spec_model.py``,
  ``spec.autoscaling`` ``autoscaling.py``, ``spec.monitoring`` ``monitoring.py``,
  ``spec.routing`` ``routing.py``; this module parses the other sections, makes the checks
  across fields, and derives what the builders need (the SHM store and /dev/shm volume sizes).
- Every check the API server's schema/CEL rules make is repeated here, plus checks CEL cannot
  make (does the cache fit in the memory it lives in?). A violation raises
  :class:`InvalidSpecError` naming the field and what to change; the handlers turn it into a
  ``Degraded`` condition and an event, never a crash loop.
- Sizes are whole bytes; the builders never re-parse strings.
- Policy is apart from validity: :func:`refused_by_policy` says which valid fields this
  operator's settings refuse (``engine.faultEvictRate`` without ``--allow-fault-injection``);
  the builders stay pure and build any valid spec.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mmis_operator import quantity
from mmis_operator.autoscaling import AutoscalingSpec, parse_autoscaling
from mmis_operator.monitoring import MonitoringSpec, parse_monitoring
from mmis_operator.routing import RoutingSpec, parse_routing
from mmis_operator.spec_errors import InvalidSpecError as InvalidSpecError
from mmis_operator.spec_fields import DEFAULTS as DEFAULTS
from mmis_operator.spec_fields import (
    read_bytes,
    read_cpu,
    read_int,
    read_int_or_percent,
    read_ratio,
    read_section,
)
from mmis_operator.spec_model import ModelSpec, parse_model

MiB = 1 << 20
SHM_HEADROOM_MIN = 512 * MiB  # /dev/shm space beyond the store: torch, tokenizers, IPC


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    max_surge: int | str
    max_unavailable: int | str


@dataclasses.dataclass(frozen=True)
class DisruptionSpec:
    enabled: bool
    max_unavailable: int | str


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    type: str
    size_bytes: int
    engine_size_bytes: int | None
    shm_store_bytes: int  # the SHM object store (0 in lru mode)
    shm_volume_bytes: int  # the /dev/shm emptyDir sizeLimit = store + headroom
    drift_threshold: float
    drift_window_seconds: int | None


@dataclasses.dataclass(frozen=True)
class ServiceSpec:
    model: ModelSpec
    replicas: int
    image: str
    image_pull_policy: str
    gpus: int
    engine_memory_bytes: int
    engine_cpu: str
    frontend_memory_bytes: int
    frontend_cpu: str
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    kv_cache_bytes: int | None
    fault_evict_rate: float | None
    cache: CacheSpec
    otlp_endpoint: str | None
    sampling_ratio: float
    api_key_secret: tuple[str, str] | None  # (secret name, key)
    allowed_local_media_path: str | None
    service_type: str
    service_port: int
    service_annotations: Mapping[str, str]
    ingress: Mapping[str, Any]  # enabled, host, className, path, tlsSecretName, annotations
    startup_timeout_seconds: int
    drain_seconds: int
    rollout: RolloutSpec
    disruption: DisruptionSpec
    scheduling: Mapping[str, Any]
    pod_template: Mapping[str, Any]
    autoscaling: AutoscalingSpec | None  # None: not enabled
    monitoring: MonitoringSpec
    routing: RoutingSpec | None = None  # None: no endpoint picker (spec.routing absent)


def _zero(value: int | str) -> bool:
    return value in (0, "0%")


def _rollout(spec: Mapping[str, Any]) -> RolloutSpec:
    section = read_section(spec, "rollout")
    surge = read_int_or_percent(section, "spec.rollout.maxSurge")
    unavailable = read_int_or_percent(section, "spec.rollout.maxUnavailable")
    if _zero(surge) and _zero(unavailable):
        raise InvalidSpecError(
            "spec.rollout",
            "maxSurge and maxUnavailable cannot both be 0: the rollout could never replace a pod",
        )
    return RolloutSpec(max_surge=surge, max_unavailable=unavailable)


def _disruption(spec: Mapping[str, Any]) -> DisruptionSpec:
    section = read_section(spec, "disruption")
    enabled = section.get("enabled", DEFAULTS["disruption.enabled"])
    if not isinstance(enabled, bool):
        raise InvalidSpecError("spec.disruption.enabled", f"must be a boolean, got {enabled!r}")
    return DisruptionSpec(
        enabled=enabled,
        max_unavailable=read_int_or_percent(section, "spec.disruption.maxUnavailable"),
    )


def _cache(spec: Mapping[str, Any]) -> CacheSpec:
    cache = read_section(spec, "cache")
    kind = cache.get("type", DEFAULTS["cache.type"])
    if kind not in ("lru", "shm"):
        raise InvalidSpecError("spec.cache.type", f"must be lru or shm, got {kind!r}")
    size = read_bytes(cache, "spec.cache.size") or 0
    shm = read_bytes(cache, "spec.cache.shmSize")
    if kind == "shm" and shm is not None and shm < size:
        raise InvalidSpecError(
            "spec.cache",
            f"with type shm, shmSize ({quantity.format_bytes(shm)}) must be at least size "
            f"({quantity.format_bytes(size)}): the shared-memory store holds every cached item",
        )
    store = (size if shm is None else shm) if kind == "shm" else (shm or 0)
    threshold = read_ratio(cache, "spec.cache.driftThreshold")
    return CacheSpec(
        type=kind,
        size_bytes=size,
        engine_size_bytes=read_bytes(cache, "spec.cache.engineSize"),
        shm_store_bytes=store,
        shm_volume_bytes=store + shm_headroom(store),
        drift_threshold=DEFAULTS["cache.driftThreshold"] if threshold is None else threshold,
        drift_window_seconds=read_int(cache, "spec.cache.driftWindowSeconds", low=10),
    )


def shm_headroom(store: int) -> int:
    """Space on /dev/shm beyond the store: 10% of it, at least 512Mi, whole MiB."""
    tenth_mib = -(-store // (10 * MiB))
    return max(SHM_HEADROOM_MIN, tenth_mib * MiB)


def _fits(spec: ServiceSpec) -> None:
    """Checks CEL cannot make: the engine's caches must fit in the engine's memory."""
    engine_cache = spec.cache.engine_size_bytes
    receiver = spec.cache.size_bytes if engine_cache is None else engine_cache
    kv = spec.kv_cache_bytes if spec.gpus == 0 and spec.kv_cache_bytes else 0
    if receiver + kv >= spec.engine_memory_bytes:
        need = quantity.format_bytes(receiver + kv)
        raise InvalidSpecError(
            "spec.resources.memory",
            f"{quantity.format_bytes(spec.engine_memory_bytes)} cannot hold the engine's "
            f"multimodal cache{' and CPU KV cache' if kv else ''} ({need}) plus the model: "
            "raise resources.memory or lower cache.engineSize / cache.size",
        )


def parse_spec(spec: Mapping[str, Any]) -> ServiceSpec:
    """Parse a raw ``spec`` mapping (as stored by the API server) into a :class:`ServiceSpec`."""
    if not isinstance(spec, Mapping):
        raise InvalidSpecError("spec", "must be an object")
    res, eng = read_section(spec, "resources"), read_section(spec, "engine")
    tel, svc, probes = (
        read_section(spec, "telemetry"),
        read_section(spec, "service"),
        read_section(spec, "probes"),
    )
    auth, key = (
        read_section(spec, "auth").get("apiKeySecretRef"),
        DEFAULTS["auth.apiKeySecretRef.key"],
    )
    parsed = ServiceSpec(
        model=parse_model(spec),
        replicas=read_int(spec, "spec.replicas"),
        image=str(spec.get("image") or DEFAULTS["image"]),
        image_pull_policy=str(spec.get("imagePullPolicy") or DEFAULTS["imagePullPolicy"]),
        gpus=read_int(res, "spec.resources.gpus"),
        engine_memory_bytes=read_bytes(res, "spec.resources.memory") or 0,
        engine_cpu=read_cpu(res, "spec.resources.cpu"),
        frontend_memory_bytes=read_bytes(res, "spec.resources.frontendMemory") or 0,
        frontend_cpu=read_cpu(res, "spec.resources.frontendCpu"),
        max_num_seqs=read_int(eng, "spec.engine.maxNumSeqs", low=1),
        max_num_batched_tokens=read_int(eng, "spec.engine.maxNumBatchedTokens", low=1),
        kv_cache_bytes=read_bytes(eng, "spec.engine.kvCacheMemory"),
        fault_evict_rate=read_ratio(eng, "spec.engine.faultEvictRate"),
        cache=_cache(spec),
        otlp_endpoint=tel.get("otlpEndpoint") or None,
        sampling_ratio=read_ratio(tel, "spec.telemetry.samplingRatio") or 0.0,
        api_key_secret=(str(auth["name"]), str(auth.get("key") or key)) if auth else None,
        allowed_local_media_path=spec.get("allowedLocalMediaPath") or None,
        service_type=str(svc.get("type") or DEFAULTS["service.type"]),
        service_port=read_int(svc, "spec.service.port", low=1),
        service_annotations=dict(svc.get("annotations") or {}),
        ingress={
            **read_section(spec, "ingress"),
            "path": read_section(spec, "ingress").get("path") or DEFAULTS["ingress.path"],
        },
        startup_timeout_seconds=read_int(probes, "spec.probes.startupTimeoutSeconds", low=10),
        drain_seconds=read_int(probes, "spec.probes.drainSeconds"),
        rollout=_rollout(spec),
        disruption=_disruption(spec),
        scheduling=dict(read_section(spec, "scheduling")),
        pod_template=dict(read_section(spec, "podTemplate")),
        autoscaling=parse_autoscaling(spec),
        monitoring=parse_monitoring(spec),
        routing=parse_routing(spec),
    )
    if parsed.engine_memory_bytes <= 0 or parsed.frontend_memory_bytes <= 0:
        raise InvalidSpecError("spec.resources", "memory and frontendMemory must be positive")
    if parsed.ingress.get("enabled") and not parsed.ingress.get("host"):
        raise InvalidSpecError("spec.ingress", "enabled requires host")
    _fits(parsed)
    return parsed


def refused_by_policy(spec: ServiceSpec, allow_fault_injection: bool) -> InvalidSpecError | None:
    """A field this operator's settings refuse (None: nothing refused). Testing knobs run only
    where the operator was started with ``--allow-fault-injection``."""
    if spec.fault_evict_rate and not allow_fault_injection:
        return InvalidSpecError(
            "spec.engine.faultEvictRate",
            "is a testing knob (the engine evicts cache entries on purpose); this operator "
            "refuses it: remove the field, or run the operator with --allow-fault-injection",
        )
    return None
