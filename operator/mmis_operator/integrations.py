"""Optional third-party APIs the operator uses when the cluster serves them: KEDA's
``ScaledObject``, prometheus-operator's ``PodMonitor`` and the Gateway API Inference
Extension's ``InferencePool`` (``spec.routing``, routing.py); found by API discovery.

Invariants:
- :class:`Integrations` is the operator's setting for them, read from the environment (the
  chart sets it; ``mmis operator`` has no flag for it yet):
  ``MMIS_OPERATOR_AUTOSCALER`` = ``auto`` (default: a ScaledObject when KEDA's CRD is served,
  else an HPA) | ``hpa`` | ``keda``; ``MMIS_OPERATOR_POD_MONITORS`` = ``auto`` (default: a
  PodMonitor per resource when the CRD is served) | ``off`` (e.g. the chart's own cluster-wide
  PodMonitor is enabled instead). A bad value fails at start-up, naming the variable.
- :class:`Discovery` asks the API server's discovery endpoint (readable by every
  authenticated user: no RBAC) and caches each answer for ``ttl`` seconds, so a CRD installed
  later is used within a minute and a reconcile costs no discovery request otherwise. An
  unreachable API server raises ``KubeError`` (retryable), never "absent".
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Mapping

from mmis_operator.kube import Kube

AUTOSCALERS = ("auto", "hpa", "keda")
POD_MONITORS = ("auto", "off")
ENV_AUTOSCALER = "MMIS_OPERATOR_AUTOSCALER"
ENV_POD_MONITORS = "MMIS_OPERATOR_POD_MONITORS"
KEDA = ("keda.sh/v1alpha1", "scaledobjects")
PROMETHEUS_OPERATOR = ("monitoring.coreos.com/v1", "podmonitors")
INFERENCE_POOL = ("inference.networking.k8s.io/v1", "inferencepools")


@dataclasses.dataclass(frozen=True)
class Integrations:
    autoscaler: str = "auto"  # which object spec.autoscaling becomes: auto | hpa | keda
    pod_monitors: str = "auto"  # a PodMonitor per resource: auto | off

    def __post_init__(self) -> None:
        if self.autoscaler not in AUTOSCALERS:
            raise ValueError(
                f"{ENV_AUTOSCALER} must be one of {', '.join(AUTOSCALERS)}, got {self.autoscaler!r}"
            )
        if self.pod_monitors not in POD_MONITORS:
            raise ValueError(
                f"{ENV_POD_MONITORS} must be one of {', '.join(POD_MONITORS)}, "
                f"got {self.pod_monitors!r}"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Integrations:
        env = os.environ if env is None else env
        return cls(
            autoscaler=env.get(ENV_AUTOSCALER, "auto").strip().lower() or "auto",
            pod_monitors=env.get(ENV_POD_MONITORS, "auto").strip().lower() or "auto",
        )


class Discovery:
    """Which optional resources the API server serves, cached for ``ttl`` seconds."""

    def __init__(
        self, kube: Kube, ttl: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.kube = kube
        self.ttl = ttl
        self.clock = clock
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], tuple[float, bool]] = {}

    def serves(self, group_version: str, plural: str) -> bool:
        key = (group_version, plural)
        now = self.clock()
        with self._lock:
            cached = self._seen.get(key)
        if cached is not None and now - cached[0] < self.ttl:
            return cached[1]
        found = self.kube.get(f"/apis/{group_version}")  # 404: the group is not served
        names = {res.get("name") for res in (found or {}).get("resources") or []}
        served = plural in names
        with self._lock:
            self._seen[key] = (now, served)
        return served

    def keda(self) -> bool:
        return self.serves(*KEDA)

    def pod_monitors(self) -> bool:
        return self.serves(*PROMETHEUS_OPERATOR)

    def inference_pools(self) -> bool:
        return self.serves(*INFERENCE_POOL)


def autoscaler_kind(settings: Integrations, discovery: Discovery) -> str:
    """The kind ``spec.autoscaling`` becomes: HorizontalPodAutoscaler or ScaledObject."""
    if settings.autoscaler == "hpa":
        return "HorizontalPodAutoscaler"
    if settings.autoscaler == "keda" or discovery.keda():
        return "ScaledObject"
    return "HorizontalPodAutoscaler"


def pod_monitors_wanted(settings: Integrations, discovery: Discovery) -> bool:
    return settings.pod_monitors != "off" and discovery.pod_monitors()
