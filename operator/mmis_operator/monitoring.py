"""``spec.monitoring``: how Prometheus finds a resource's pods. A prometheus-operator
``PodMonitor`` per resource (when the cluster serves monitoring.coreos.com/v1 PodMonitor), and
plain-Prometheus ``prometheus.io/*`` annotations on the pods.

Invariants:
- Pure: (owner, parsed spec) in, manifest out; whether the PodMonitor CRD exists (API
  discovery) and whether the operator's setting ``MMIS_OPERATOR_POD_MONITORS=off`` turns them
  off is the reconciler's business (:mod:`mmis_operator.integrations`).
- Both point at the front end's operations port (``resource.OPS_PORT``, named ``ops``, path
  /metrics, no API key), which no Service or Ingress exposes: scraping is pod to pod.
- The PodMonitor selects exactly the resource's pods (``resource.selector_labels``) and adds
  the ``mmis.dev/service`` pod label to every series (as ``mmis_dev_service``).
- Defaults live in :data:`DEFAULTS` (merged into ``spec.DEFAULTS``, equal to the CRD's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mmis_operator import resource as r
from mmis_operator.spec_errors import InvalidSpecError

API_VERSION = "monitoring.coreos.com/v1"
METRICS_PATH = "/metrics"
DEFAULTS: dict[str, Any] = {
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
    value = section.get(key, DEFAULTS[f"monitoring.{key}"])
    if not isinstance(value, bool):
        raise InvalidSpecError(f"spec.monitoring.{key}", f"must be a boolean, got {value!r}")
    return value


def parse_monitoring(spec: Mapping[str, Any]) -> MonitoringSpec:
    section = spec.get("monitoring") or {}
    if not isinstance(section, Mapping):
        raise InvalidSpecError("spec.monitoring", "must be an object")
    interval = str(section.get("interval") or DEFAULTS["monitoring.interval"])
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


def scrape_annotations(monitoring: MonitoringSpec) -> dict[str, str]:
    """The plain-Prometheus pod annotations (the kubernetes_sd convention), or none."""
    if not monitoring.scrape_annotations:
        return {}
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(r.OPS_PORT),
        "prometheus.io/path": METRICS_PATH,
    }


def pod_monitor(
    owner: Mapping[str, Any], metadata: Mapping[str, Any], monitoring: MonitoringSpec
) -> dict[str, Any]:
    """The PodMonitor of one resource's pods (scraped on ``ops``)."""
    name = owner["metadata"]["name"]
    return {
        "apiVersion": API_VERSION,
        "kind": "PodMonitor",
        "metadata": dict(metadata),
        "spec": {
            "selector": {"matchLabels": r.selector_labels(name)},
            "podTargetLabels": [r.LABEL_SERVICE],
            "podMetricsEndpoints": [
                {"port": r.OPS_PORT_NAME, "path": METRICS_PATH, "interval": monitoring.interval}
            ],
        },
    }
