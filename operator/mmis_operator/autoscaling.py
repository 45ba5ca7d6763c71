"""``spec.autoscaling``: parsed, and rendered as an ``autoscaling/v2`` HorizontalPodAutoscaler
or a KEDA ``ScaledObject`` (keda.sh/v1alpha1, a prometheus trigger).

Invariants:
- Pure: (owner, parsed spec) in, manifest out; which of the two kinds to render is decided by
  the reconciler (API discovery, or the operator's ``MMIS_OPERATOR_AUTOSCALER`` setting,
  :mod:`mmis_operator.integrations`), never here.
- Both target the MMInferenceService's own scale subresource (``scaleTargetRef`` kind
  MMInferenceService; the CRD's ``labelSelectorPath`` is ``.status.selector``), never the
  Deployment. So the autoscaler owns ``spec.replicas`` of the resource, the operator copies it
  to the Deployment (clamped into [minReplicas, maxReplicas]), and nobody fights over the
  Deployment's replicas. Manifests applied by people should then leave ``spec.replicas`` out.
- The metric is one the front end exports on its ops port (server/mmis/telemetry/catalog.py)
  under the Gateway API Inference Extension's model-server protocol names:
  ``mmis:num_requests_waiting`` (TotalQueuedRequests; vLLM: ``vllm:num_requests_waiting``) and
  ``mmis:kv_cache_usage_perc`` (KVCacheUtilization, a fraction in [0, 1]; vLLM:
  ``vllm:kv_cache_usage_perc``). ``target`` is the per-pod average the autoscaler aims at.
- Every default lives in :data:`DEFAULTS` (merged into ``spec.DEFAULTS``, equal to the CRD's);
  a violation raises :class:`~mmis_operator.spec_errors.InvalidSpecError` naming the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mmis_operator import resource as r
from mmis_operator.spec_errors import InvalidSpecError

WAITING = "mmis:num_requests_waiting"
KV_USAGE = "mmis:kv_cache_usage_perc"
METRICS = (WAITING, KV_USAGE)
HPA_API_VERSION = "autoscaling/v2"
KEDA_API_VERSION = "keda.sh/v1alpha1"
MAX_REPLICAS = 1000
MAX_WINDOW_SECONDS = 3600
# CRD path (below spec) -> default; merged into spec.DEFAULTS
DEFAULTS: dict[str, Any] = {
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


def _window(section: Mapping[str, Any], key: str) -> int:
    value = section.get(key, DEFAULTS[f"autoscaling.{key}"])
    whole = isinstance(value, int) and not isinstance(value, bool)
    if not whole or not 0 <= value <= MAX_WINDOW_SECONDS:
        raise InvalidSpecError(
            f"spec.autoscaling.{key}",
            f"must be whole seconds in [0, {MAX_WINDOW_SECONDS}], got {value!r}",
        )
    return value


def _replicas(section: Mapping[str, Any], key: str) -> int:
    value = section.get(key, DEFAULTS.get(f"autoscaling.{key}"))
    if value is None:
        raise InvalidSpecError(f"spec.autoscaling.{key}", "is required when enabled is true")
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_REPLICAS:
        raise InvalidSpecError(
            f"spec.autoscaling.{key}", f"must be an integer in [1, {MAX_REPLICAS}], got {value!r}"
        )
    return value


def parse_autoscaling(spec: Mapping[str, Any]) -> AutoscalingSpec | None:
    """``spec.autoscaling`` parsed; None when it is absent or not enabled."""
    section = spec.get("autoscaling") or {}
    if not isinstance(section, Mapping):
        raise InvalidSpecError("spec.autoscaling", "must be an object")
    enabled = section.get("enabled", DEFAULTS["autoscaling.enabled"])
    if not isinstance(enabled, bool):
        raise InvalidSpecError("spec.autoscaling.enabled", f"must be a boolean, got {enabled!r}")
    if not enabled:
        return None
    low, high = _replicas(section, "minReplicas"), _replicas(section, "maxReplicas")
    if low > high:
        raise InvalidSpecError(
            "spec.autoscaling", f"minReplicas ({low}) must not exceed maxReplicas ({high})"
        )
    metric = section.get("metric", DEFAULTS["autoscaling.metric"])
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
    address = section.get("prometheusAddress") or DEFAULTS["autoscaling.prometheusAddress"]
    return AutoscalingSpec(
        min_replicas=low,
        max_replicas=high,
        metric=metric,
        target=float(target),
        scale_up_window_seconds=_window(section, "scaleUpStabilizationSeconds"),
        scale_down_window_seconds=_window(section, "scaleDownStabilizationSeconds"),
        prometheus_address=str(address),
    )


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
