"""The MMInferenceService's defaults, and the typed readers that apply them to one field.

Invariants:
- :data:`DEFAULTS` is the operator's one home for defaults (re-exported as ``spec.DEFAULTS``;
  ``spec.autoscaling``, ``spec.monitoring`` and ``spec.routing`` bring theirs from
  ``autoscaling.py``, ``monitoring.py`` and ``routing.py``); the CRD's ``default:`` values
  equal it (``tests/operator/test_spec.py`` walks the CRD), so a resource stored before a
  default existed reconciles the same as a new one.
- Server settings get no default here unless the operator needs the value itself: the cache
  type and size (they size the /dev/shm volume and the memory limits). Those equal the
  server's one definition (``tests/contract/test_settings_defaults.py``); every other server
  setting is ``None`` when unset and its flag is then not passed (the server's default holds).
- Rollout defaults (``maxSurge 0, maxUnavailable 1``) cannot deadlock a node whose GPUs are
  all taken: an old pod is stopped before its replacement asks for a GPU.
- A reader is given the field's CRD path (``spec.engine.maxNumSeqs``) and reads its last part
  from the section; an absent field is its default (``None`` when it has none). A value of the
  wrong type or out of range raises :class:`~mmis_operator.spec_errors.InvalidSpecError`
  naming that path and what to change; nothing here raises anything else on user input.
- Sizes are parsed once, to whole bytes (:func:`read_bytes`); CPU amounts stay the strings
  the user wrote, checked positive (:func:`read_cpu`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mmis_operator import autoscaling, monitoring, quantity, routing
from mmis_operator.spec_errors import InvalidSpecError

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
    **routing.DEFAULTS,  # spec.routing (routing.py)
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
        return quantity.parse_bytes(value, field)
    except quantity.QuantityError as exc:
        raise InvalidSpecError(field, str(exc).split(": ", 1)[1]) from exc


def read_cpu(section: Mapping[str, Any], field: str) -> str:
    value = section.get(field.rsplit(".", 1)[1], default(field))
    try:
        amount = quantity.parse(value, field)
    except quantity.QuantityError as exc:
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
