"""The MMInferenceService spec, parsed into frozen dataclasses with every default applied.

Invariants:
- :data:`DEFAULTS` is the operator's one home for defaults; the CRD's ``default:`` values
  equal it (``tests/operator/test_spec.py`` walks the CRD), so a resource stored before a
  default existed reconciles the same as a new one.
- Server settings get no default here unless the operator needs the value itself: the cache
  type and size (they size the /dev/shm volume and the memory limits). Those equal the
  server's one definition (``tests/contract/test_settings_defaults.py``); every other server
  setting is ``None`` when unset and its flag is then not passed (the server's default holds).
- Every check the API server's schema/CEL rules make is repeated here, plus checks CEL cannot
  make (does the cache fit in the memory it lives in?). A violation raises
  :class:`InvalidSpecError` naming the field and what to change; the handlers turn it into a
  ``Degraded`` condition and an event, never a crash loop.
- Sizes are whole bytes; the builders never re-parse strings.
- Policy is apart from validity: :func:`refused_by_policy` says which valid fields this
  operator's settings refuse (``engine.faultEvictRate`` without ``--allow-fault-injection``);
  the builders stay pure and build any valid spec.
- Rollout defaults (``maxSurge 0, maxUnavailable 1``) cannot deadlock a node whose GPUs are
  all taken: an old pod is stopped before its replacement asks for a GPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mmis_operator import autoscaling, monitoring, quantity
from mmis_operator.autoscaling import AutoscalingSpec, parse_autoscaling
from mmis_operator.monitoring import MonitoringSpec, parse_monitoring
from mmis_operator.spec_errors import InvalidSpecError as InvalidSpecError

MiB = 1 << 20
SHM_HEADROOM_MIN = 512 * MiB  # /dev/shm space beyond the store: torch, tokenizers, IPC
# CRD path (below spec) -> default
DEFAULTS: dict[str, Any] = {
    "replicas": 1,
    "image": "ghcr.io/mmis-dev/mmis-server:0.1.0",
    "imagePullPolicy": "IfNotPresent",
    "resources.gpus": 1,
    "resources.memory": "16Gi",
    "resources.cpu": "4",
    "resources.frontendMemory": "4Gi",
    "resources.frontendCpu": "2",
    "cache.type": "lru",  # server: mm_cache_type
    "cache.size": "4Gi",  # server: mm_cache_gb
    "cache.driftThreshold": 0.01,
    "telemetry.samplingRatio": 1.0,
    "auth.apiKeySecretRef.key": "api-key",
    "service.type": "ClusterIP",
    "service.port": 8000,
    "ingress.enabled": False,
    "ingress.path": "/",
    "probes.startupTimeoutSeconds": 1800,
    "probes.drainSeconds": 15,
    "model.storage.type": "EmptyDir",
    "model.storage.size": "50Gi",
    "model.storage.accessMode": "ReadWriteOnce",
    "model.tokenSecretRef.key": "token",
    # surge 0 / unavailable 1: a rollout frees a pod's GPUs before the new pod asks for them,
    # so it completes on a node with no spare GPU (surge 1 would wait for one forever)
    "rollout.maxSurge": 0,
    "rollout.maxUnavailable": 1,
    "disruption.enabled": True,
    "disruption.maxUnavailable": 1,
    **autoscaling.DEFAULTS,  # spec.autoscaling (autoscaling.py)
    **monitoring.DEFAULTS,  # spec.monitoring (monitoring.py)
}
STORAGE_TYPES = ("EmptyDir", "PersistentVolumeClaim")
ACCESS_MODES = ("ReadWriteOnce", "ReadWriteOncePod", "ReadWriteMany")


@dataclasses.dataclass(frozen=True)
class StorageSpec:
    """Where the model cache lives: an emptyDir (``sizeLimit`` = ``size_bytes``, the same
    ephemeral-storage request), a claim the operator creates (``create_claim``, ``size_bytes``,
    ``storage_class``, ``access_mode``) or an existing claim (``claim_name``)."""

    type: str  # EmptyDir | PersistentVolumeClaim
    size_bytes: int
    claim_name: str | None  # an existing claim (not created, not deleted)
    storage_class: str | None
    access_mode: str

    @property
    def create_claim(self) -> bool:
        return self.type == "PersistentVolumeClaim" and self.claim_name is None


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str  # the id or the path, whichever is set
    is_path: bool
    revision: str | None
    served_name: str
    processor_kwargs: Mapping[str, Any]
    storage: StorageSpec
    token_secret: tuple[str, str] | None  # (secret name, key): HF_TOKEN of the download


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


def _section(spec: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = spec.get(key) or {}
    if not isinstance(value, Mapping):
        raise InvalidSpecError(f"spec.{key}", f"must be an object, got {type(value).__name__}")
    return value


def _default(field: str) -> Any:
    return DEFAULTS.get(field.removeprefix("spec."))


def _int(section: Mapping[str, Any], field: str, low: int = 0) -> Any:
    value = section.get(field.rsplit(".", 1)[1], _default(field))
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSpecError(field, f"must be an integer, got {value!r}")
    if value < low:
        raise InvalidSpecError(field, f"must be at least {low}, got {value}")
    return value


def _ratio(section: Mapping[str, Any], field: str) -> float | None:
    value = section.get(field.rsplit(".", 1)[1], _default(field))
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise InvalidSpecError(field, f"must be a number in [0, 1], got {value!r}")
    return float(value)


def _bytes(section: Mapping[str, Any], field: str) -> int | None:
    value = section.get(field.rsplit(".", 1)[1], _default(field))
    if value is None:
        return None
    try:
        return quantity.parse_bytes(value, field)
    except quantity.QuantityError as exc:
        raise InvalidSpecError(field, str(exc).split(": ", 1)[1]) from exc


def _cpu(section: Mapping[str, Any], field: str) -> str:
    value = section.get(field.rsplit(".", 1)[1], _default(field))
    try:
        amount = quantity.parse(value, field)
    except quantity.QuantityError as exc:
        raise InvalidSpecError(field, str(exc).split(": ", 1)[1]) from exc
    if amount <= 0:
        raise InvalidSpecError(field, f"must be positive, got {value!r}")
    return str(value)


def _model(spec: Mapping[str, Any]) -> ModelSpec:
    if "model" not in spec:
        raise InvalidSpecError("spec.model", "is required: set model.id or model.path")
    model = _section(spec, "model")
    ident, path = model.get("id"), model.get("path")
    if bool(ident) == bool(path):
        raise InvalidSpecError(
            "spec.model",
            "set exactly one of id (a Hugging Face model id) or path (a directory inside the pod)",
        )
    if path and not str(path).startswith("/"):
        raise InvalidSpecError("spec.model.path", f"must be an absolute path, got {path!r}")
    name = str(ident or path)
    kwargs = model.get("processorKwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise InvalidSpecError("spec.model.processorKwargs", "must be an object")
    token = model.get("tokenSecretRef")
    if token is not None and (not isinstance(token, Mapping) or not token.get("name")):
        raise InvalidSpecError("spec.model.tokenSecretRef", "needs name (a Secret)")
    if token and path:
        raise InvalidSpecError(
            "spec.model.tokenSecretRef", "is for downloading model.id; model.path is not downloaded"
        )
    return ModelSpec(
        name=name,
        is_path=bool(path),
        revision=model.get("revision") or None,
        served_name=str(model.get("servedName") or name),
        processor_kwargs=dict(kwargs),
        storage=_storage(model),
        token_secret=(
            (str(token["name"]), str(token.get("key") or DEFAULTS["model.tokenSecretRef.key"]))
            if token
            else None
        ),
    )


def _storage(model: Mapping[str, Any]) -> StorageSpec:
    raw = model.get("storage") or {}
    if not isinstance(raw, Mapping):
        raise InvalidSpecError("spec.model.storage", "must be an object")
    kind = raw.get("type", DEFAULTS["model.storage.type"])
    if kind not in STORAGE_TYPES:
        raise InvalidSpecError(
            "spec.model.storage.type", f"must be one of {', '.join(STORAGE_TYPES)}, got {kind!r}"
        )
    mode = raw.get("accessMode", DEFAULTS["model.storage.accessMode"])
    if mode not in ACCESS_MODES:
        raise InvalidSpecError(
            "spec.model.storage.accessMode",
            f"must be one of {', '.join(ACCESS_MODES)}, got {mode!r}",
        )
    claim = raw.get("claimName") or None
    if claim and kind != "PersistentVolumeClaim":
        raise InvalidSpecError("spec.model.storage", "claimName needs type PersistentVolumeClaim")
    if claim and raw.get("storageClassName"):
        raise InvalidSpecError(
            "spec.model.storage",
            "set claimName (an existing claim) or storageClassName (a claim the operator "
            "creates), not both",
        )
    size = _bytes(raw, "spec.model.storage.size") or 0
    if size <= 0:
        raise InvalidSpecError("spec.model.storage.size", "must be positive")
    return StorageSpec(
        type=kind,
        size_bytes=size,
        claim_name=claim,
        storage_class=raw.get("storageClassName") or None,
        access_mode=mode,
    )


def _int_or_percent(section: Mapping[str, Any], field: str) -> int | str:
    value = section.get(field.rsplit(".", 1)[1], _default(field))
    if isinstance(value, str) and value.endswith("%") and value[:-1].isdigit():
        if int(value[:-1]) > 100:
            raise InvalidSpecError(field, f"a percentage must be at most 100%, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidSpecError(
            field, f"must be a whole number of pods or a percentage such as 25%, got {value!r}"
        )
    return value


def _zero(value: int | str) -> bool:
    return value in (0, "0%")


def _rollout(spec: Mapping[str, Any]) -> RolloutSpec:
    section = _section(spec, "rollout")
    surge = _int_or_percent(section, "spec.rollout.maxSurge")
    unavailable = _int_or_percent(section, "spec.rollout.maxUnavailable")
    if _zero(surge) and _zero(unavailable):
        raise InvalidSpecError(
            "spec.rollout",
            "maxSurge and maxUnavailable cannot both be 0: the rollout could never replace a pod",
        )
    return RolloutSpec(max_surge=surge, max_unavailable=unavailable)


def _disruption(spec: Mapping[str, Any]) -> DisruptionSpec:
    section = _section(spec, "disruption")
    enabled = section.get("enabled", DEFAULTS["disruption.enabled"])
    if not isinstance(enabled, bool):
        raise InvalidSpecError("spec.disruption.enabled", f"must be a boolean, got {enabled!r}")
    return DisruptionSpec(
        enabled=enabled, max_unavailable=_int_or_percent(section, "spec.disruption.maxUnavailable")
    )


def _cache(spec: Mapping[str, Any]) -> CacheSpec:
    cache = _section(spec, "cache")
    kind = cache.get("type", DEFAULTS["cache.type"])
    if kind not in ("lru", "shm"):
        raise InvalidSpecError("spec.cache.type", f"must be lru or shm, got {kind!r}")
    size = _bytes(cache, "spec.cache.size") or 0
    shm = _bytes(cache, "spec.cache.shmSize")
    if kind == "shm" and shm is not None and shm < size:
        raise InvalidSpecError(
            "spec.cache",
            f"with type shm, shmSize ({quantity.format_bytes(shm)}) must be at least size "
            f"({quantity.format_bytes(size)}): the shared-memory store holds every cached item",
        )
    store = (size if shm is None else shm) if kind == "shm" else (shm or 0)
    threshold = _ratio(cache, "spec.cache.driftThreshold")
    return CacheSpec(
        type=kind,
        size_bytes=size,
        engine_size_bytes=_bytes(cache, "spec.cache.engineSize"),
        shm_store_bytes=store,
        shm_volume_bytes=store + shm_headroom(store),
        drift_threshold=DEFAULTS["cache.driftThreshold"] if threshold is None else threshold,
        drift_window_seconds=_int(cache, "spec.cache.driftWindowSeconds", low=10),
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
    res, eng = _section(spec, "resources"), _section(spec, "engine")
    tel, svc, probes = (
        _section(spec, "telemetry"),
        _section(spec, "service"),
        _section(spec, "probes"),
    )
    auth, key = _section(spec, "auth").get("apiKeySecretRef"), DEFAULTS["auth.apiKeySecretRef.key"]
    parsed = ServiceSpec(
        model=_model(spec),
        replicas=_int(spec, "spec.replicas"),
        image=str(spec.get("image") or DEFAULTS["image"]),
        image_pull_policy=str(spec.get("imagePullPolicy") or DEFAULTS["imagePullPolicy"]),
        gpus=_int(res, "spec.resources.gpus"),
        engine_memory_bytes=_bytes(res, "spec.resources.memory") or 0,
        engine_cpu=_cpu(res, "spec.resources.cpu"),
        frontend_memory_bytes=_bytes(res, "spec.resources.frontendMemory") or 0,
        frontend_cpu=_cpu(res, "spec.resources.frontendCpu"),
        max_num_seqs=_int(eng, "spec.engine.maxNumSeqs", low=1),
        max_num_batched_tokens=_int(eng, "spec.engine.maxNumBatchedTokens", low=1),
        kv_cache_bytes=_bytes(eng, "spec.engine.kvCacheMemory"),
        fault_evict_rate=_ratio(eng, "spec.engine.faultEvictRate"),
        cache=_cache(spec),
        otlp_endpoint=tel.get("otlpEndpoint") or None,
        sampling_ratio=_ratio(tel, "spec.telemetry.samplingRatio") or 0.0,
        api_key_secret=(str(auth["name"]), str(auth.get("key") or key)) if auth else None,
        allowed_local_media_path=spec.get("allowedLocalMediaPath") or None,
        service_type=str(svc.get("type") or DEFAULTS["service.type"]),
        service_port=_int(svc, "spec.service.port", low=1),
        service_annotations=dict(svc.get("annotations") or {}),
        ingress={
            **_section(spec, "ingress"),
            "path": _section(spec, "ingress").get("path") or DEFAULTS["ingress.path"],
        },
        startup_timeout_seconds=_int(probes, "spec.probes.startupTimeoutSeconds", low=10),
        drain_seconds=_int(probes, "spec.probes.drainSeconds"),
        rollout=_rollout(spec),
        disruption=_disruption(spec),
        scheduling=dict(_section(spec, "scheduling")),
        pod_template=dict(_section(spec, "podTemplate")),
        autoscaling=parse_autoscaling(spec),
        monitoring=parse_monitoring(spec),
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
