"""The MMInferenceService spec, parsed into frozen dataclasses with every default applied.

Owns (each a section below): the error every parser raises (:class:`InvalidSpecError`), the
Kubernetes quantities spec fields hold, ``spec.autoscaling``, ``spec.monitoring``,
``spec.routing`` and ``spec.encoder`` as parsed specs (the objects they become are
:mod:`mmis_operator.builders`', :mod:`mmis_operator.routing`'s and
:mod:`mmis_operator.encoder`'s), ``spec.frontend`` (how many P0 processes, the P0 container's
requests), the defaults (:data:`DEFAULTS`) and the typed readers of one
field, ``spec.model``, the whole spec (:func:`parse_spec`, the checks across fields, policy) and
the merge of a user's ``podTemplate`` over the generated pod template (:func:`merge`). Pure: no
I/O, and no import of any other module of the operator.

Invariants:
- Errors: :class:`InvalidSpecError` carries ``field``, the CRD path of the offending field
  (``spec.autoscaling.target``), and a message that says what to change; the reconciler turns
  it into ``Degraded`` (InvalidSpec) and an event, never a crash loop. Nothing here raises
  anything else on user input.
- Every check the API server's schema/CEL rules make is repeated here, plus checks CEL cannot
  make (does the cache fit in the memory it lives in?).
- Policy is apart from validity: :func:`refused_by_policy` says which valid fields this
  operator's settings refuse (``engine.faultEvictRate`` without ``--allow-fault-injection``);
  the builders stay pure and build any valid spec.
- Quantities: parsing is exact (``Decimal``): "1.5Gi" is exactly 1.5 * 2**30. A malformed
  quantity raises :class:`QuantityError` naming the field, never ``ValueError``.
  :func:`format_bytes` writes the largest binary suffix that represents the value exactly, so
  a round trip through the API server never changes the number.
- Sizes are parsed once, to whole bytes (:func:`read_bytes`); the builders never re-parse
  strings. CPU amounts stay the strings the user wrote, checked positive (:func:`read_cpu`).
  The builders get what they need derived here (the SHM store and /dev/shm volume sizes).
- Defaults: :data:`DEFAULTS` is the operator's one home for defaults (``spec.autoscaling``,
  ``spec.monitoring`` and ``spec.routing`` bring theirs: :data:`AUTOSCALING_DEFAULTS`,
  :data:`MONITORING_DEFAULTS`, :data:`ROUTING_DEFAULTS`, merged into it); the CRD's
  ``default:`` values equal it (``tests/operator/test_spec.py`` walks the CRD), so a resource
  stored before a default existed reconciles the same as a new one.
- Server settings get no default here unless the operator needs the value itself: the cache
  type and size (they size the /dev/shm volume and the memory limits). Those equal the
  server's one definition (``tests/contract/test_settings_defaults.py``); every other server
  setting is ``None`` when unset and its flag is then not passed (the server's default holds).
- Rollout defaults (``maxSurge 0, maxUnavailable 1``) cannot deadlock a node whose GPUs are
  all taken: an old pod is stopped before its replacement asks for a GPU.
- A reader is given the field's CRD path (``spec.engine.maxNumSeqs``) and reads its last part
  from the section; an absent field is its default (``None`` when it has none). A value of the
  wrong type or out of range raises :class:`InvalidSpecError` naming that path and what to
  change.
- ``spec.model``: exactly one of ``id`` (a Hugging Face model id, downloaded into the cache)
  or ``path`` (an absolute directory inside the pod, never downloaded) is set; ``name`` is
  whichever it is, and the served name defaults to it. ``tokenSecretRef`` (``HF_TOKEN`` of the
  download) names a Secret and only goes with ``id``. The cache is an emptyDir or a
  PersistentVolumeClaim: an existing one (``claimName``, neither created nor deleted by the
  operator) or one the operator creates (optionally of ``storageClassName``), never both; its
  size is positive whole bytes.
- ``spec.autoscaling``: the metric is one the front end exports on its ops port
  (server/mmis/telemetry/catalog.py) under the Gateway API Inference Extension's model-server
  protocol names: ``mmis:num_requests_waiting`` (TotalQueuedRequests; vLLM:
  ``vllm:num_requests_waiting``) and ``mmis:kv_cache_usage_perc`` (KVCacheUtilization, a
  fraction in [0, 1]; vLLM: ``vllm:kv_cache_usage_perc``). ``target`` is the per-pod average
  the autoscaler aims at. Absent or not enabled, it parses to None.
- ``spec.routing``: absent, it parses to None and nothing changes (no object, no pod argument,
  no port). The picker image's default follows the operator's version (:func:`default_image`),
  so it has no CRD default (one stored in the resource would pin an old picker across operator
  upgrades).
- ``spec.frontend.apiServers`` (:func:`parse_frontend`): N P0 processes in the front-end
  container (``mmis frontend --api-servers N``), 1..64. ``resources.frontendCpu`` and
  ``resources.frontendMemory`` are always the P0 *container's* requests, shared by its N
  processes: set, each is taken exactly as written; unset, each is N times one process's
  request (:data:`PROCESS_DEFAULTS`: 2 CPUs, 4Gi), so neither has a CRD default (a stored
  default could not be told from a value the user wrote). ``apiServers`` unset is derived from
  the container's CPU request: one process per :data:`CPUS_PER_API_SERVER` CPUs, at least 1,
  at most :data:`DERIVED_API_SERVERS_MAX`; today's default request (2) gives 1, and with
  everything unset the pod is byte for byte what it was before the field existed.
- Serving settings (:data:`ENGINE_FLAGS`, :data:`FRONTEND_FLAGS`, :func:`server_flag_args`):
  each is one server flag, passed only when the field is set (a switch only for its
  non-default value), so a spec without them builds the pods it built before; a set field
  reaches the server as the value written (``tests/operator/test_serving_settings.py`` parses
  the args with the real ``mmis engine`` / ``mmis frontend``). Settings deliberately left out
  of the spec, and why: docs/kubernetes.md.
- ``spec.encoder`` (:func:`parse_encoder`): absent, it parses to None and nothing changes (no
  object, no flag, no env). Its fields have no CRD default (:data:`ENCODER_DEFAULTS`; the
  encoders' GPUs follow ``resources.gpus``: 1 when the PD pods use GPUs, else 0). Its
  autoscaler always reads :data:`ENCODER_QUEUE` and has the bounds and windows of
  ``spec.autoscaling``. Its ``podTemplate`` is merged over the encoder pods' template
  (:func:`merge`, the rules of ``spec.podTemplate``, which is the inference pods' only).
- ``spec.adapters`` (:func:`parse_adapters`): absent, None (no LoRA: the pods as before);
  present, even empty, a tuple of :class:`AdapterSpec` whose names are unique, never the base
  model's served name and never hold a comma or a space (the routing metric joins names with
  commas), and whose sources resolve to the path the pod loads (:func:`parse_adapter_source`:
  an absolute path, ``pvc://CLAIM/PATH`` under :data:`ADAPTER_CLAIMS_DIR`, or ``hf://ORG/NAME
  [@REV]`` as is); no path holds ``..``. ``engine.maxLoras`` / ``maxLoraRank`` /
  ``maxCpuLoras`` are serving settings (:data:`ENGINE_FLAGS`), ``maxCpuLoras >= maxLoras``.
- The ``podTemplate`` override (:func:`merge`): mappings merge recursively; the override wins
  on scalars. Lists of named items (containers, volumes, env, volumeMounts, ports, ...) merge
  item by item on ``name``: an override entry updates the generated entry of the same name,
  new names are appended, generated entries the override does not mention are kept. Except
  ``volumes``: an override volume replaces the generated volume of the same name whole (a
  volume has exactly one source; merging an ``emptyDir`` with a ``persistentVolumeClaim``
  would give two, which the API server rejects). Any other list is replaced as a whole
  (``tolerations``, ``args``, ``command``). Inputs are never mutated; the result shares no
  mutable structure with them.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.metadata
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

# --- Errors (was spec_errors.py) ------------------------------------------------------------------


class InvalidSpecError(ValueError):
    """The spec cannot be turned into pods; ``field`` says where, the message says how to fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


# --- Quantities (was quantity.py) -----------------------------------------------------------------

_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_PATTERN = re.compile(
    r"^(?P<num>[+-]?(?:\d+\.?\d*|\.\d+))(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$"
)
GiB = 1 << 30


class QuantityError(ValueError):
    """A spec field holds something that is not a Kubernetes quantity."""

    def __init__(self, field: str, value: object) -> None:
        super().__init__(
            f"{field}: {value!r} is not a Kubernetes quantity (examples: 4Gi, 512Mi, 2, 500m)"
        )
        self.field = field
        self.value = value


def parse(value: object, field: str) -> Decimal:
    """Parse an int, float or quantity string; returns the value in base units."""
    if isinstance(value, bool):
        raise QuantityError(field, value)
    if isinstance(value, int | float):
        return Decimal(str(value))
    if not isinstance(value, str):
        raise QuantityError(field, value)
    match = _PATTERN.match(value.strip())
    if match is None:
        raise QuantityError(field, value)
    number = Decimal(match["num"])  # the pattern admits only decimals
    suffix = match["suffix"] or ""
    if suffix in _BINARY:
        return number * (Decimal(1024) ** _BINARY[suffix])
    if suffix in _DECIMAL:
        return number * (Decimal(10) ** _DECIMAL[suffix])
    return number * (Decimal(10) ** int(suffix[1:]))


def parse_bytes(value: object, field: str) -> int:
    """Parse a memory quantity into whole bytes (rounded up); negative is an error."""
    amount = parse(value, field)
    if amount < 0:
        raise QuantityError(field, value)
    return int(amount.to_integral_value(rounding="ROUND_CEILING"))


def format_bytes(count: int) -> str:
    """Write a byte count with the largest exact binary suffix (``3221225472`` -> ``3Gi``)."""
    if count < 0:
        raise ValueError(f"negative byte count {count}")
    for suffix, power in sorted(_BINARY.items(), key=lambda kv: -kv[1]):
        unit = 1024**power
        if count and count % unit == 0:
            return f"{count // unit}{suffix}"
    return str(count)


def gib(count: int) -> str:
    """Bytes as a GiB decimal string for the ``--*-gb`` CLI flags (at most 4 decimals)."""
    text = f"{count / GiB:.4f}".rstrip("0").rstrip(".")
    return text or "0"


# --- spec.autoscaling (was the parsing half of autoscaling.py) ------------------------------------

WAITING = "mmis:num_requests_waiting"
KV_USAGE = "mmis:kv_cache_usage_perc"
METRICS = (WAITING, KV_USAGE)
AUTOSCALING_MAX_REPLICAS = 1000
MAX_WINDOW_SECONDS = 3600
# CRD path (below spec) -> default; merged into DEFAULTS (below)
AUTOSCALING_DEFAULTS: dict[str, Any] = {
    "autoscaling.enabled": False,
    "autoscaling.minReplicas": 1,
    "autoscaling.metric": WAITING,
    "autoscaling.scaleUpStabilizationSeconds": 0,
    # GPU pods take minutes to load a model: do not give one back on a short lull
    "autoscaling.scaleDownStabilizationSeconds": 300,
    # prometheus-operator's Service for a Prometheus named "k8s"/any in namespace monitoring
    "autoscaling.prometheusAddress": "http://prometheus-operated.monitoring.svc:9090",
}


@dataclasses.dataclass(frozen=True)
class AutoscalingSpec:
    min_replicas: int
    max_replicas: int
    metric: str  # one of METRICS
    target: float  # per-pod average
    scale_up_window_seconds: int
    scale_down_window_seconds: int
    prometheus_address: str  # the KEDA trigger's Prometheus

    def clamp(self, replicas: int) -> int:
        """``replicas`` within [min, max]: what the Deployment runs until the autoscaler acts."""
        return max(self.min_replicas, min(self.max_replicas, replicas))


def _window(section: Mapping[str, Any], key: str, where: str = "spec.autoscaling") -> int:
    value = section.get(key, AUTOSCALING_DEFAULTS[f"autoscaling.{key}"])
    whole = isinstance(value, int) and not isinstance(value, bool)
    if not whole or not 0 <= value <= MAX_WINDOW_SECONDS:
        raise InvalidSpecError(
            f"{where}.{key}",
            f"must be whole seconds in [0, {MAX_WINDOW_SECONDS}], got {value!r}",
        )
    return value


def _replicas(section: Mapping[str, Any], key: str, where: str = "spec.autoscaling") -> int:
    value = section.get(key, AUTOSCALING_DEFAULTS.get(f"autoscaling.{key}"))
    if value is None:
        raise InvalidSpecError(f"{where}.{key}", "is required when enabled is true")
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not 1 <= value <= AUTOSCALING_MAX_REPLICAS
    ):
        raise InvalidSpecError(
            f"{where}.{key}",
            f"must be an integer in [1, {AUTOSCALING_MAX_REPLICAS}], got {value!r}",
        )
    return value


def parse_autoscaling(spec: Mapping[str, Any]) -> AutoscalingSpec | None:
    """``spec.autoscaling`` parsed; None when it is absent or not enabled."""
    section = spec.get("autoscaling") or {}
    if not isinstance(section, Mapping):
        raise InvalidSpecError("spec.autoscaling", "must be an object")
    enabled = section.get("enabled", AUTOSCALING_DEFAULTS["autoscaling.enabled"])
    if not isinstance(enabled, bool):
        raise InvalidSpecError("spec.autoscaling.enabled", f"must be a boolean, got {enabled!r}")
    if not enabled:
        return None
    low, high = _replicas(section, "minReplicas"), _replicas(section, "maxReplicas")
    if low > high:
        raise InvalidSpecError(
            "spec.autoscaling", f"minReplicas ({low}) must not exceed maxReplicas ({high})"
        )
    metric = section.get("metric", AUTOSCALING_DEFAULTS["autoscaling.metric"])
    if metric not in METRICS:
        raise InvalidSpecError(
            "spec.autoscaling.metric", f"must be one of {', '.join(METRICS)}, got {metric!r}"
        )
    target = section.get("target")
    if target is None:
        raise InvalidSpecError(
            "spec.autoscaling.target",
            "is required when enabled is true: the per-pod average of the metric to aim at",
        )
    if isinstance(target, bool) or not isinstance(target, int | float) or target <= 0:
        raise InvalidSpecError("spec.autoscaling.target", f"must be positive, got {target!r}")
    if metric == KV_USAGE and target > 1:
        raise InvalidSpecError(
            "spec.autoscaling.target",
            f"{KV_USAGE} is a fraction in [0, 1] (1 = full); got {target!r}, e.g. use 0.8",
        )
    address = (
        section.get("prometheusAddress") or AUTOSCALING_DEFAULTS["autoscaling.prometheusAddress"]
    )
    return AutoscalingSpec(
        min_replicas=low,
        max_replicas=high,
        metric=metric,
        target=float(target),
        scale_up_window_seconds=_window(section, "scaleUpStabilizationSeconds"),
        scale_down_window_seconds=_window(section, "scaleDownStabilizationSeconds"),
        prometheus_address=str(address),
    )


# --- spec.monitoring (was the parsing half of monitoring.py) --------------------------------------

MONITORING_DEFAULTS: dict[str, Any] = {
    "monitoring.podMonitor": True,
    "monitoring.scrapeAnnotations": True,
    "monitoring.interval": "15s",
}


@dataclasses.dataclass(frozen=True)
class MonitoringSpec:
    pod_monitor: bool  # a PodMonitor, when the cluster has the CRD
    scrape_annotations: bool  # prometheus.io/scrape, port, path on the pods
    interval: str


def _flag(section: Mapping[str, Any], key: str) -> bool:
    value = section.get(key, MONITORING_DEFAULTS[f"monitoring.{key}"])
    if not isinstance(value, bool):
        raise InvalidSpecError(f"spec.monitoring.{key}", f"must be a boolean, got {value!r}")
    return value


def parse_monitoring(spec: Mapping[str, Any]) -> MonitoringSpec:
    section = spec.get("monitoring") or {}
    if not isinstance(section, Mapping):
        raise InvalidSpecError("spec.monitoring", "must be an object")
    interval = str(section.get("interval") or MONITORING_DEFAULTS["monitoring.interval"])
    digits = interval.rstrip("smh")
    if not digits.isdigit() or interval[-1:] not in ("s", "m", "h") or int(digits) <= 0:
        raise InvalidSpecError(
            "spec.monitoring.interval", f"must be a duration such as 15s or 1m, got {interval!r}"
        )
    return MonitoringSpec(
        pod_monitor=_flag(section, "podMonitor"),
        scrape_annotations=_flag(section, "scrapeAnnotations"),
        interval=interval,
    )


# --- spec.routing (was the parsing half of routing.py) --------------------------------------------

CACHE_WEIGHT = 3  # the cache scorer's weight against 1 each for queue and KV usage (routing.py)
IMAGE_REPOSITORY = "ghcr.io/mmis-dev/mmis-epp"
PICKER_MAX_REPLICAS = 5
MAX_CACHE_WEIGHT = 100
# CRD path (below spec) -> default; merged into DEFAULTS (below)
ROUTING_DEFAULTS: dict[str, Any] = {
    "routing.picker.replicas": 1,
    "routing.cacheWeight": CACHE_WEIGHT,
}


@dataclasses.dataclass(frozen=True)
class RoutingSpec:
    image: str  # the picker's image
    replicas: int  # picker pods (more than one elect a leader)
    cache_weight: int  # the cache scorer's weight (queue and KV usage weigh 1 each)


def default_image() -> str:
    """``mmis-epp`` tagged with this operator's version (``latest`` when it has none)."""
    try:
        version = importlib.metadata.version("mmis-operator")
    except importlib.metadata.PackageNotFoundError:
        version = "latest"
    return f"{IMAGE_REPOSITORY}:{version}"


def _bounded(section: Mapping[str, Any], field: str, low: int, high: int) -> int:
    value = section.get(field.rsplit(".", 1)[1], ROUTING_DEFAULTS[field.removeprefix("spec.")])
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidSpecError(field, f"must be a whole number in [{low}, {high}], got {value!r}")
    return value


def parse_routing(spec: Mapping[str, Any]) -> RoutingSpec | None:
    """``spec.routing``, or None when absent (no picker)."""
    section = spec.get("routing")
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise InvalidSpecError("spec.routing", f"must be an object, got {type(section).__name__}")
    picker = section.get("picker") or {}
    if not isinstance(picker, Mapping):
        raise InvalidSpecError("spec.routing.picker", "must be an object")
    image = picker.get("image") or default_image()
    if not isinstance(image, str):
        raise InvalidSpecError("spec.routing.picker.image", f"must be a string, got {image!r}")
    return RoutingSpec(
        image=image,
        replicas=_bounded(picker, "spec.routing.picker.replicas", 1, PICKER_MAX_REPLICAS),
        cache_weight=_bounded(section, "spec.routing.cacheWeight", 0, MAX_CACHE_WEIGHT),
    )


# --- spec.frontend: P0 processes per pod ----------------------------------------------------------

API_SERVERS_MAX = 64  # the server's bound (mmis frontend --api-servers 1..64)
# One P0 process keeps about two cores busy under image load: its render worker (fetch, decode,
# resize, the processor, hashing: one thread) and its event loop with the tokenizing worker
# (HTTP, JSON, templating, detokenizing). So a derived default gives each process two CPUs of
# the container's request, and today's default request (2) stays one process.
CPUS_PER_API_SERVER = 2
# A derived default stops at 8 (KServe's LLMInferenceService runs vLLM with 8 API servers):
# every process is a whole P0 (its own processor, tokenizer, shadow and engine connection, one
# more output topic for P1 to publish), so past 8 the per-process cost outgrows what a default
# should pick. More is a deliberate choice: set apiServers (up to API_SERVERS_MAX).
DERIVED_API_SERVERS_MAX = 8
# One P0 process's requests: resources.frontendCpu / frontendMemory, when unset, are these
# times the number of processes (they have no CRD default; see parse_frontend)
PROCESS_DEFAULTS: dict[str, str] = {
    "resources.frontendCpu": "2",
    "resources.frontendMemory": "4Gi",
}


@dataclasses.dataclass(frozen=True)
class FrontendResources:
    """The P0 container: ``api_servers`` processes sharing ``cpu`` and ``memory_bytes`` (the
    container's requests, before the /dev/shm volume the builders add to its memory)."""

    api_servers: int
    cpu: str
    memory_bytes: int


def derived_api_servers(cpu: Decimal) -> int:
    """The default of ``spec.frontend.apiServers`` for a P0 container requesting ``cpu`` CPUs:
    one process per :data:`CPUS_PER_API_SERVER`, at least 1, at most
    :data:`DERIVED_API_SERVERS_MAX` (2 -> 1, 3 -> 1, 4 -> 2, 16 -> 8, 64 -> 8)."""
    whole = int(cpu // CPUS_PER_API_SERVER)
    return max(1, min(DERIVED_API_SERVERS_MAX, whole))


def _times(cpu: str, count: int) -> str:
    """``count`` times the CPU quantity ``cpu``, whole CPUs as such, else millicores."""
    total = parse(cpu, "spec.resources.frontendCpu") * count
    return str(int(total)) if total == total.to_integral_value() else f"{int(total * 1000)}m"


def parse_frontend(spec: Mapping[str, Any]) -> FrontendResources:
    """``spec.frontend.apiServers`` with ``spec.resources.frontendCpu`` / ``frontendMemory``
    (see the module invariants): the number of P0 processes and the container's requests."""
    res, front = read_section(spec, "resources"), read_section(spec, "frontend")
    field = "spec.frontend.apiServers"
    count = front.get("apiServers")
    if count is not None and (
        isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= API_SERVERS_MAX
    ):
        raise InvalidSpecError(
            field, f"must be a whole number in [1, {API_SERVERS_MAX}], got {count!r}"
        )
    cpu_set, memory_set = res.get("frontendCpu"), res.get("frontendMemory")
    cpu = read_cpu(res, "spec.resources.frontendCpu") if cpu_set is not None else None
    if count is None:
        request = PROCESS_DEFAULTS["resources.frontendCpu"] if cpu is None else cpu
        count = derived_api_servers(parse(request, "spec.resources.frontendCpu"))
    if cpu is None:
        cpu = _times(PROCESS_DEFAULTS["resources.frontendCpu"], count)
    if memory_set is not None:
        memory = read_bytes(res, "spec.resources.frontendMemory") or 0
    else:
        memory = count * parse_bytes(PROCESS_DEFAULTS["resources.frontendMemory"], field)
    return FrontendResources(api_servers=count, cpu=cpu, memory_bytes=memory)


# --- Serving settings: spec.engine / spec.frontend fields that become server flags ---------------


@dataclasses.dataclass(frozen=True)
class ServerFlag:
    """One serving setting of the spec passed through as one server flag. ``field``: the CRD
    path below ``spec`` (``engine.dtype``); ``kind``: ``int``, ``number``, ``choice`` or
    ``switch`` (a boolean whose ``flag`` is passed only when the value is ``when``; the other
    value is the server's default, so it passes nothing). ``low``/``high`` bound numbers
    (inclusive; ``above`` makes ``low`` exclusive)."""

    field: str
    flag: str
    kind: str
    low: float | None = None
    high: float | None = None
    above: bool = False
    choices: tuple[str, ...] = ()
    when: bool = True


LOG_LEVELS = ("debug", "info", "warning", "error")  # python logging levels, both servers'
MAX_LORAS = 1024  # engine.maxLoras / maxCpuLoras: the CRD's bound (the server's is >= 1)
MAX_LORA_RANK = 1024  # engine.maxLoraRank: the CRD's bound (the server's is >= 1)
# mmis engine (server/mmis/engine/config.py). Each has no CRD default: unset, no flag, the
# server's default holds. Bounds equal the server's rules (tests/operator/test_serving_settings).
ENGINE_FLAGS: tuple[ServerFlag, ...] = (
    ServerFlag("engine.dtype", "--dtype", "choice",
               choices=("auto", "bfloat16", "float16", "float32")),
    ServerFlag("engine.maxModelLen", "--max-model-len", "int", low=2, high=16777216),
    ServerFlag("engine.gpuMemoryUtilization", "--gpu-memory-utilization", "number",
               low=0, high=1, above=True),
    ServerFlag("engine.blockSize", "--block-size", "int", low=1, high=4096),
    ServerFlag("engine.enablePrefixCaching", "--no-prefix-caching", "switch", when=False),
    ServerFlag("engine.enforceEager", "--enforce-eager", "switch"),
    ServerFlag("engine.asyncScheduling", "--async-scheduling", "choice",
               choices=("auto", "on", "off")),
    ServerFlag("engine.attentionBackend", "--attention-backend", "choice",
               choices=("auto", "flex", "torch")),
    ServerFlag("engine.encoderCacheTokens", "--encoder-cache-tokens", "int", low=1,
               high=16777216),
    ServerFlag("engine.selfCheck", "--no-self-check", "switch", when=False),
    # spec.adapters' engine limits (--enable-lora itself follows spec.adapters' presence)
    ServerFlag("engine.maxLoras", "--max-loras", "int", low=1, high=MAX_LORAS),
    ServerFlag("engine.maxLoraRank", "--max-lora-rank", "int", low=1, high=MAX_LORA_RANK),
    ServerFlag("engine.maxCpuLoras", "--max-cpu-loras", "int", low=1, high=MAX_LORAS),
    ServerFlag("telemetry.logLevel", "--log-level", "choice", choices=LOG_LEVELS),
)  # fmt: skip
# mmis frontend (server/mmis/frontend/config.py); engine.maxModelLen and telemetry.logLevel go
# to both sides (shared settings: P0 refuses a prompt the engine could never hold)
FRONTEND_FLAGS: tuple[ServerFlag, ...] = (
    ServerFlag("engine.maxModelLen", "--max-model-len", "int", low=2, high=16777216),
    ServerFlag("frontend.maxImagesPerPrompt", "--max-images-per-prompt", "int", low=1,
               high=1024),
    ServerFlag("frontend.maxVideosPerPrompt", "--max-videos-per-prompt", "int", low=0,
               high=64),
    ServerFlag("frontend.videoFps", "--video-fps", "number", low=0, high=120, above=True),
    ServerFlag("frontend.videoMinFrames", "--video-min-frames", "int", low=1, high=4096),
    ServerFlag("frontend.videoMaxFrames", "--video-max-frames", "int", low=1, high=4096),
    ServerFlag("frontend.mediaMaxBytes", "--media-max-bytes", "int", low=1, high=1 << 34),
    ServerFlag("frontend.mediaMaxPixels", "--media-max-pixels", "int", low=1, high=1 << 34),
    ServerFlag("frontend.maxRequestBodyMb", "--max-request-body-mb", "int", low=1,
               high=4096),
    ServerFlag("frontend.maxN", "--max-n", "int", low=1, high=1024),
    ServerFlag("frontend.generationConfig", "--generation-config", "choice",
               choices=("auto", "none")),
    ServerFlag("frontend.enableMmEmbeds", "--enable-mm-embeds", "switch"),
    ServerFlag("frontend.failFast", "--fail-fast", "switch"),
    ServerFlag("telemetry.logLevel", "--log-level", "choice", choices=LOG_LEVELS),
)  # fmt: skip


def _number_text(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def server_flag_args(spec: Mapping[str, Any], flags: tuple[ServerFlag, ...]) -> tuple[str, ...]:
    """The flags these settings of a raw spec pass, in ``flags``' order; a wrong type or a
    value out of bounds is an :class:`InvalidSpecError` naming the field and what to write."""
    args: list[str] = []
    for item in flags:
        section, key = item.field.split(".")
        value = read_section(spec, section).get(key)
        path = f"spec.{item.field}"
        if value is None:
            continue
        if item.kind == "switch":
            if not isinstance(value, bool):
                raise InvalidSpecError(path, f"must be true or false, got {value!r}")
            args += [item.flag] if value == item.when else []
            continue
        if item.kind == "choice":
            if value not in item.choices:
                raise InvalidSpecError(
                    path, f"must be one of {', '.join(item.choices)}, got {value!r}"
                )
            args += [item.flag, str(value)]
            continue
        number = (int,) if item.kind == "int" else (int, float)
        if isinstance(value, bool) or not isinstance(value, number):
            raise InvalidSpecError(
                path, f"must be {'an integer' if number == (int,) else 'a number'}, got {value!r}"
            )
        low, high = item.low, item.high
        if (low is not None and (value <= low if item.above else value < low)) or (
            high is not None and value > high
        ):
            bound = f"above {low:g}" if item.above else f"at least {low:g}"
            raise InvalidSpecError(path, f"must be {bound} and at most {high:g}, got {value!r}")
        args += [item.flag, _number_text(value)]
    return tuple(args)


# --- spec.encoder: the pool's encoder pods (E/PD, issue 46) ---------------------------------------

# The metric the encoder autoscaler reads: items received and not yet answered by one
# ``mmis encoder`` (queued plus in its running batch), on its health port's /metrics. Defined
# here for the operator; the encoder process must export it under this name.
ENCODER_QUEUE = "mmis_encoder_queue_items"
ENCODER_MAX_REPLICAS = 1000
# spec.encoder's fields have no CRD default (as spec.frontend.apiServers): unset, these, and
# resources.gpus follows the PD pods (1 when they use GPUs, else 0: a CPU pool gets CPU
# encoders). The autoscaler's windows and Prometheus are AUTOSCALING_DEFAULTS'.
ENCODER_DEFAULTS: dict[str, Any] = {
    "encoder.replicas": 1,
    "encoder.resources.cpu": "2",
    "encoder.resources.memory": "8Gi",
}


@dataclasses.dataclass(frozen=True)
class EncoderSpec:
    """``spec.encoder``: the encoder Deployment's size (``replicas`` until an autoscaler owns
    it), each encoder container's requests, the autoscaler (None: a fixed count) and the
    encoder pods' own ``podTemplate`` override (``spec.podTemplate`` is the inference pods')."""

    replicas: int
    gpus: int
    cpu: str
    memory_bytes: int
    autoscaling: AutoscalingSpec | None
    pod_template: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _encoder_autoscaling(section: Mapping[str, Any]) -> AutoscalingSpec | None:
    """``spec.encoder.autoscaling`` (the metric is always :data:`ENCODER_QUEUE`)."""
    where = "spec.encoder.autoscaling"
    auto = section.get("autoscaling") or {}
    if not isinstance(auto, Mapping):
        raise InvalidSpecError(where, "must be an object")
    enabled = auto.get("enabled", False)
    if not isinstance(enabled, bool):
        raise InvalidSpecError(f"{where}.enabled", f"must be a boolean, got {enabled!r}")
    if not enabled:
        return None
    low = _replicas(auto, "minReplicas", where)
    high = _replicas(auto, "maxReplicas", where)
    if low > high:
        raise InvalidSpecError(where, f"minReplicas ({low}) must not exceed maxReplicas ({high})")
    target = auto.get("target")
    if target is None:
        raise InvalidSpecError(
            f"{where}.target",
            f"is required when enabled is true: the per-encoder average of {ENCODER_QUEUE}",
        )
    if isinstance(target, bool) or not isinstance(target, int | float) or target <= 0:
        raise InvalidSpecError(f"{where}.target", f"must be positive, got {target!r}")
    address = auto.get("prometheusAddress") or AUTOSCALING_DEFAULTS["autoscaling.prometheusAddress"]
    return AutoscalingSpec(
        min_replicas=low,
        max_replicas=high,
        metric=ENCODER_QUEUE,
        target=float(target),
        scale_up_window_seconds=_window(auto, "scaleUpStabilizationSeconds", where),
        scale_down_window_seconds=_window(auto, "scaleDownStabilizationSeconds", where),
        prometheus_address=str(address),
    )


def parse_encoder(spec: Mapping[str, Any], pd_gpus: int) -> EncoderSpec | None:
    """``spec.encoder``, or None when absent (no encoder, the pods exactly as without it);
    ``pd_gpus`` is ``spec.resources.gpus`` (the default of the encoders' GPUs follows it)."""
    section = spec.get("encoder")
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise InvalidSpecError("spec.encoder", f"must be an object, got {type(section).__name__}")
    replicas = section.get("replicas", ENCODER_DEFAULTS["encoder.replicas"])
    if (
        isinstance(replicas, bool)
        or not isinstance(replicas, int)
        or not 1 <= replicas <= ENCODER_MAX_REPLICAS
    ):
        raise InvalidSpecError(
            "spec.encoder.replicas",
            f"must be a whole number in [1, {ENCODER_MAX_REPLICAS}], got {replicas!r}",
        )
    res = section.get("resources") or {}
    if not isinstance(res, Mapping):
        raise InvalidSpecError("spec.encoder.resources", "must be an object")
    gpus = res.get("gpus", 1 if pd_gpus else 0)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 0 <= gpus <= 64:
        raise InvalidSpecError(
            "spec.encoder.resources.gpus", f"must be a whole number in [0, 64], got {gpus!r}"
        )
    cpu = read_cpu(
        {"cpu": res.get("cpu", ENCODER_DEFAULTS["encoder.resources.cpu"])},
        "spec.encoder.resources.cpu",
    )
    memory = read_bytes(
        {"memory": res.get("memory", ENCODER_DEFAULTS["encoder.resources.memory"])},
        "spec.encoder.resources.memory",
    )
    if not memory:
        raise InvalidSpecError("spec.encoder.resources.memory", "must be positive")
    return EncoderSpec(
        replicas=replicas,
        gpus=gpus,
        cpu=cpu,
        memory_bytes=memory,
        autoscaling=_encoder_autoscaling(section),
        pod_template=_encoder_pod_template(section),
    )


def _encoder_pod_template(section: Mapping[str, Any]) -> dict[str, Any]:
    override = section.get("podTemplate") or {}
    if not isinstance(override, Mapping):
        raise InvalidSpecError("spec.encoder.podTemplate", "must be an object")
    return dict(override)


# --- spec.adapters: LoRA adapters pushed to the running pods (issue 47) -------------------------

ADAPTERS_MAX = 128  # entries of spec.adapters (the CRD's maxItems)
ADAPTER_NAME_MAX = 128
# a served model name: letters, digits and . _ : / - (no comma: the routing metric joins names
# with commas; no space), starting with a letter or digit
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
# pvc://<claim>/<path>: the claim (a DNS label short enough for the volume name "lora-<claim>")
# is mounted read-only at ADAPTER_CLAIMS_DIR/<claim> in both containers
ADAPTER_CLAIMS_DIR = "/mnt/mmis-adapters"
ADAPTER_CLAIM_MAX = 58
ADAPTER_CLAIM = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# hf://<org>/<name>[@<revision>]: downloaded by the pod (P0), HF_TOKEN from model.tokenSecretRef
ADAPTER_HUB = re.compile(
    r"^hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?$"
)
ADAPTER_SOURCE_HELP = (
    "an absolute path on the model volume (/var/cache/mmis/adapters/a), pvc://CLAIM/PATH or "
    "hf://ORG/NAME[@REVISION]"
)


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    """One entry of ``spec.adapters``: ``name`` (the model name clients send), ``source`` as
    written, ``path`` what the pod loads (``lora_path`` of ``POST
    /internal/load_lora_adapter``: the absolute path, the claim's mount path joined with the
    path, or the ``hf://`` id itself) and ``claim`` (the pvc:// claim, else None)."""

    name: str
    source: str
    path: str
    claim: str | None = None


def _relative_ok(path: str) -> bool:
    parts = path.split("/")
    return bool(path) and ".." not in parts and not any(c.isspace() for c in path)


def parse_adapter_source(source: object, field: str) -> tuple[str, str | None]:
    """``(path the pod loads, claim or None)`` of one adapter source (see
    :data:`ADAPTER_SOURCE_HELP`); anything else is an :class:`InvalidSpecError` on ``field``."""
    bad = InvalidSpecError(field, f"must be {ADAPTER_SOURCE_HELP}, got {source!r}")
    if not isinstance(source, str) or len(source) > 1024:
        raise bad
    if source.startswith("/"):
        if not _relative_ok(source.lstrip("/")):
            raise bad
        return source.rstrip("/") or source, None
    if source.startswith("pvc://"):
        claim, _, rest = source.removeprefix("pvc://").partition("/")
        if not (
            ADAPTER_CLAIM.match(claim) and len(claim) <= ADAPTER_CLAIM_MAX and _relative_ok(rest)
        ):
            raise bad
        return f"{ADAPTER_CLAIMS_DIR}/{claim}/{rest.strip('/')}", claim
    if source.startswith("hf://") and ADAPTER_HUB.match(source):
        return source, None
    raise bad


def parse_adapters(spec: Mapping[str, Any], served_name: str) -> tuple[AdapterSpec, ...] | None:
    """``spec.adapters``, or None when absent (the pods then run without ``--enable-lora``).
    Names are unique and never the base model's served name."""
    raw = spec.get("adapters")
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) > ADAPTERS_MAX:
        raise InvalidSpecError(
            "spec.adapters", f"must be a list of at most {ADAPTERS_MAX} {{name, source}} entries"
        )
    found: list[AdapterSpec] = []
    for i, item in enumerate(raw):
        where = f"spec.adapters[{i}]"
        if not isinstance(item, Mapping):
            raise InvalidSpecError(where, "must be an object with name and source")
        name = item.get("name")
        if (
            not isinstance(name, str)
            or len(name) > ADAPTER_NAME_MAX
            or not ADAPTER_NAME.match(name)
        ):
            raise InvalidSpecError(
                f"{where}.name",
                f"must be a model name of 1 to {ADAPTER_NAME_MAX} letters, digits and . _ : / - "
                f"starting with a letter or digit, got {name!r}",
            )
        if name == served_name:
            raise InvalidSpecError(
                f"{where}.name", f"{name!r} is the base model's served name: pick another"
            )
        if any(a.name == name for a in found):
            raise InvalidSpecError(f"{where}.name", f"{name!r} appears twice: names are unique")
        source = item.get("source")
        path, claim = parse_adapter_source(source, f"{where}.source")
        found.append(AdapterSpec(name=name, source=str(source), path=path, claim=claim))
    return tuple(found)


def adapter_claims(adapters: tuple[AdapterSpec, ...] | None) -> tuple[str, ...]:
    """The pvc:// claims the pods mount (sorted, each once): a new claim changes the pod
    template; the rest of the list never does."""
    return tuple(sorted({a.claim for a in adapters or () if a.claim}))


# --- Defaults and field readers (was spec_fields.py) ----------------------------------------------

# CRD path (below spec) -> default
DEFAULTS: dict[str, Any] = {
    "replicas": 1,
    "image": "ghcr.io/mmis-dev/mmis-server:0.1.0",
    "imagePullPolicy": "IfNotPresent",
    "resources.gpus": 1,
    "resources.memory": "16Gi",
    "resources.cpu": "4",
    # resources.frontendCpu / frontendMemory: PROCESS_DEFAULTS times spec.frontend.apiServers
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
    **AUTOSCALING_DEFAULTS,  # spec.autoscaling (above)
    **MONITORING_DEFAULTS,  # spec.monitoring (above)
    **ROUTING_DEFAULTS,  # spec.routing (above)
}


def read_section(spec: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """``spec[key]``, an object (``{}`` when absent or null)."""
    value = spec.get(key) or {}
    if not isinstance(value, Mapping):
        raise InvalidSpecError(f"spec.{key}", f"must be an object, got {type(value).__name__}")
    return value


def default(field: str) -> Any:
    return DEFAULTS.get(field.removeprefix("spec."))


def read_int(section: Mapping[str, Any], field: str, low: int = 0) -> Any:
    value = section.get(field.rsplit(".", 1)[1], default(field))
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSpecError(field, f"must be an integer, got {value!r}")
    if value < low:
        raise InvalidSpecError(field, f"must be at least {low}, got {value}")
    return value


def read_ratio(section: Mapping[str, Any], field: str) -> float | None:
    value = section.get(field.rsplit(".", 1)[1], default(field))
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise InvalidSpecError(field, f"must be a number in [0, 1], got {value!r}")
    return float(value)


def read_bytes(section: Mapping[str, Any], field: str) -> int | None:
    value = section.get(field.rsplit(".", 1)[1], default(field))
    if value is None:
        return None
    try:
        return parse_bytes(value, field)
    except QuantityError as exc:
        raise InvalidSpecError(field, str(exc).split(": ", 1)[1]) from exc


def read_cpu(section: Mapping[str, Any], field: str) -> str:
    value = section.get(field.rsplit(".", 1)[1], default(field))
    try:
        amount = parse(value, field)
    except QuantityError as exc:
        raise InvalidSpecError(field, str(exc).split(": ", 1)[1]) from exc
    if amount <= 0:
        raise InvalidSpecError(field, f"must be positive, got {value!r}")
    return str(value)


def read_int_or_percent(section: Mapping[str, Any], field: str) -> int | str:
    """A whole number of pods or a percentage (``"25%"``, at most 100%)."""
    value = section.get(field.rsplit(".", 1)[1], default(field))
    if isinstance(value, str) and value.endswith("%") and value[:-1].isdigit():
        if int(value[:-1]) > 100:
            raise InvalidSpecError(field, f"a percentage must be at most 100%, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidSpecError(
            field, f"must be a whole number of pods or a percentage such as 25%, got {value!r}"
        )
    return value


# --- spec.model (was spec_model.py) ---------------------------------------------------------------

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


def parse_model(spec: Mapping[str, Any]) -> ModelSpec:
    """``spec.model`` of a raw spec (required)."""
    if "model" not in spec:
        raise InvalidSpecError("spec.model", "is required: set model.id or model.path")
    model = read_section(spec, "model")
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
    size = read_bytes(raw, "spec.model.storage.size") or 0
    if size <= 0:
        raise InvalidSpecError("spec.model.storage.size", "must be positive")
    return StorageSpec(
        type=kind,
        size_bytes=size,
        claim_name=claim,
        storage_class=raw.get("storageClassName") or None,
        access_mode=mode,
    )


# --- The whole spec (was spec.py) -----------------------------------------------------------------

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
    frontend_memory_bytes: int  # the P0 container's, shared by its api_servers processes
    frontend_cpu: str  # the P0 container's request, shared by its api_servers processes
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
    api_servers: int = 1  # P0 processes in the front-end container (spec.frontend.apiServers)
    encoder: EncoderSpec | None = None  # None: no encoder pods (spec.encoder absent)
    engine_flags: tuple[str, ...] = ()  # ENGINE_FLAGS the spec sets, as mmis engine flags
    frontend_flags: tuple[str, ...] = ()  # FRONTEND_FLAGS the spec sets, as mmis frontend flags
    adapters: tuple[AdapterSpec, ...] | None = None  # None: no LoRA (spec.adapters absent)


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
            f"with type shm, shmSize ({format_bytes(shm)}) must be at least size "
            f"({format_bytes(size)}): the shared-memory store holds every cached item",
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
        need = format_bytes(receiver + kv)
        raise InvalidSpecError(
            "spec.resources.memory",
            f"{format_bytes(spec.engine_memory_bytes)} cannot hold the engine's "
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
    front = parse_frontend(spec)
    model = parse_model(spec)
    parsed = ServiceSpec(
        model=model,
        replicas=read_int(spec, "spec.replicas"),
        image=str(spec.get("image") or DEFAULTS["image"]),
        image_pull_policy=str(spec.get("imagePullPolicy") or DEFAULTS["imagePullPolicy"]),
        gpus=read_int(res, "spec.resources.gpus"),
        engine_memory_bytes=read_bytes(res, "spec.resources.memory") or 0,
        engine_cpu=read_cpu(res, "spec.resources.cpu"),
        frontend_memory_bytes=front.memory_bytes,
        frontend_cpu=front.cpu,
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
        api_servers=front.api_servers,
        encoder=parse_encoder(spec, read_int(res, "spec.resources.gpus")),
        engine_flags=server_flag_args(spec, ENGINE_FLAGS),
        frontend_flags=server_flag_args(spec, FRONTEND_FLAGS),
        adapters=parse_adapters(spec, model.served_name),
    )
    low, high = eng.get("maxLoras"), eng.get("maxCpuLoras")
    if isinstance(low, int) and isinstance(high, int) and high < low:
        raise InvalidSpecError(
            "spec.engine.maxCpuLoras",
            f"({high}) must be at least maxLoras ({low}): the host keeps every device adapter",
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


# --- The podTemplate override (was overrides.py) --------------------------------------------------

NAMED_LISTS = frozenset(
    {
        "containers",
        "initContainers",
        "ephemeralContainers",
        "volumes",
        "env",
        "volumeMounts",
        "ports",
        "imagePullSecrets",
        "hostAliases",
        "resourceClaims",
    }
)


class OverrideError(ValueError):
    """The override has the wrong shape (e.g. a container entry without a name)."""


REPLACED_BY_NAME = frozenset({"volumes"})


def _merge_named(base: list[Any], override: list[Any], path: str, whole: bool = False) -> list[Any]:
    merged = [copy.deepcopy(item) for item in base]
    index = {item.get("name"): i for i, item in enumerate(merged) if isinstance(item, Mapping)}
    for item in override:
        if not isinstance(item, Mapping) or not item.get("name"):
            raise OverrideError(f"{path}: every entry needs a name, got {item!r}")
        name = item["name"]
        if name in index:
            merged[index[name]] = (
                copy.deepcopy(dict(item))
                if whole
                else merge(merged[index[name]], item, f"{path}[{name}]")
            )
        else:
            index[name] = len(merged)
            merged.append(copy.deepcopy(dict(item)))
    return merged


def merge(base: Mapping[str, Any], override: Mapping[str, Any], path: str = "") -> dict[str, Any]:
    """Return ``base`` with ``override`` merged over it (see the module invariants)."""
    result: dict[str, Any] = copy.deepcopy(dict(base))
    for key, value in override.items():
        where = f"{path}.{key}" if path else key
        current = result.get(key)
        if isinstance(current, Mapping) and isinstance(value, Mapping):
            result[key] = merge(current, value, where)
        elif key in NAMED_LISTS and isinstance(value, list):
            base_list = current if isinstance(current, list) else []
            result[key] = _merge_named(base_list, value, where, key in REPLACED_BY_NAME)
        else:
            result[key] = copy.deepcopy(value)
    return result
