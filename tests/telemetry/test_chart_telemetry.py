"""The chart ships the generated dashboard, rules and scrape object: rendered by real helm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "dashboards"))  # the generators: build tools
import mmis_alerts as alerts  # noqa: E402
import mmis_dashboard as dashboard  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))  # tests/tools.py
from tools import in_ci  # noqa: E402

CHART = ROOT / "charts" / "mmis"
PROMETHEUS_RULE_API = "monitoring.coreos.com/v1/PrometheusRule"
PODMONITOR_API = "monitoring.coreos.com/v1/PodMonitor"
# helm template otherwise assumes a Kubernetes older than Chart.yaml allows
KUBE = ("--kube-version", "1.36.3")


def _helm() -> Path:
    tools = Path(os.environ.get("MMIS_TOOLS_DIR") or Path.home() / ".cache" / "mmis" / "tools")
    helm = tools / "bin" / "helm"
    if not helm.is_file():
        reason = f"{helm} not built: run scripts/gotools helm (or set MMIS_TOOLS_DIR)"
        if in_ci():
            pytest.fail(reason)
        pytest.skip(reason)
    return helm


def _render(*args: str) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [str(_helm()), "template", "rel", str(CHART), "--namespace", "ns", *KUBE, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def _of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def test_dashboard_configmap_carries_the_generated_json_for_the_sidecar() -> None:
    configmaps = [
        doc
        for doc in _of_kind(_render(), "ConfigMap")
        if doc["metadata"].get("labels", {}).get("grafana_dashboard") == "1"
    ]
    assert len(configmaps) == 1
    (configmap,) = configmaps
    assert configmap["metadata"]["namespace"] == "ns"
    assert json.loads(configmap["data"]["mmis.json"]) == dashboard.build()


def test_prometheus_rule_follows_the_cluster_capability() -> None:
    assert _of_kind(_render(), "PrometheusRule") == []
    (rule,) = _of_kind(_render("--api-versions", PROMETHEUS_RULE_API), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"] == alerts.build()


def test_chart_lints_strictly_with_the_new_templates() -> None:
    proc = subprocess.run(
        [str(_helm()), "lint", "--strict", str(CHART)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_pod_monitor_scrapes_the_operations_port_of_the_operators_pods() -> None:
    """The chart's scrape object (opt-in: the operator makes one per resource by default)
    selects the pods the operator builds, on their ops port."""
    from mmis_operator import builders
    from mmis_operator import kube as r
    from mmis_operator.spec import parse_spec

    assert _of_kind(_render(), "PodMonitor") == []
    assert _of_kind(_render("--api-versions", PODMONITOR_API), "PodMonitor") == []
    monitors = _of_kind(_render("--set", "podMonitor.enabled=true"), "PodMonitor")
    # the inference pods' (the encoder pods' one: tests/operator/test_encoder.py)
    (monitor,) = [m for m in monitors if m["metadata"]["name"].endswith("-pods")]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    pod = builders.pod_template(parse_spec({"model": {"id": "acme/vlm"}}), "m")
    labels = pod["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert labels[r.LABEL_SERVICE] == "m"  # the service name, which podTargetLabels keeps
    (frontend,) = [c for c in pod["spec"]["containers"] if c["name"] == r.FRONTEND]
    ports = {p["name"]: p["containerPort"] for p in frontend["ports"]}
    assert endpoint["port"] == r.OPS_PORT_NAME and ports[r.OPS_PORT_NAME] == r.OPS_PORT
    args = frontend["args"]
    assert args[args.index("--ops-port") + 1] == str(r.OPS_PORT)
    off = _render("--api-versions", PODMONITOR_API, "--set", "podMonitor.enabled=false")
    assert _of_kind(off, "PodMonitor") == []
    # with the chart's PodMonitor on, the operator makes none of its own (no double scrape)
    (deployment,) = _of_kind(_render("--set", "podMonitor.enabled=true"), "Deployment")
    env = {
        e["name"]: e.get("value")
        for e in deployment["spec"]["template"]["spec"]["containers"][0].get("env", [])
    }
    assert env.get("MMIS_OPERATOR_POD_MONITORS") == "off"
