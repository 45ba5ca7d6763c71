"""The Helm chart against the real control plane: lint, render, dry-run, install, RBAC."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubecluster import Cluster, apply_crds, kubectl_wait

from mmis_operator.main import OperatorThread, Options

pytestmark = pytest.mark.controlplane

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "mmis"
VALUE_SETS = {
    "defaults": [],
    "peering": ["--set", "peering.enabled=true", "--set", "operator.replicas=2"],
    "namespaced": ["--set", "operator.watchNamespaces={team-a,team-b}"],
    "routing": ["--set", "routing.enabled=true"],
    "encoder": ["--set", "encoder.enabled=true"],
}
SAMPLE: dict[str, Any] = {
    "apiVersion": "mmis.dev/v1alpha1",
    "kind": "MMInferenceService",
    "metadata": {"name": "rbac-check"},
    "spec": {
        "model": {"id": "llava-hf/llava-1.5-7b-hf"},
        "resources": {"gpus": 1, "memory": "8Gi", "cpu": "1", "frontendCpu": "500m"},
        "cache": {"size": "1Gi"},
        # an HPA too, created with the chart's RBAC (KEDA and prometheus-operator absent)
        "autoscaling": {"enabled": True, "maxReplicas": 2, "target": 4},
    },
}


_SERVER_VERSIONS: dict[str, str] = {}


def _server_version(cluster: Cluster) -> str:
    key = str(cluster.kubeconfig)
    if key not in _SERVER_VERSIONS:
        out = cluster.kubectl("version", "-o", "json").stdout
        _SERVER_VERSIONS[key] = json.loads(out)["serverVersion"]["gitVersion"]
    return _SERVER_VERSIONS[key]


def _helm(cluster: Cluster, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run helm; ``template`` renders for the test cluster's version (Chart.yaml kubeVersion
    is checked against it; helm's offline default, v1.20, is refused)."""
    if args and args[0] == "template" and "--kube-version" not in args:
        args = (*args, "--kube-version", _server_version(cluster))
    proc = subprocess.run(
        [str(cluster.bin("helm")), *args],
        capture_output=True, text=True, env=cluster.env, timeout=300,
    )  # fmt: skip
    if check and proc.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def chart_crds(cluster: Cluster) -> None:
    apply_crds(
        cluster, CHART / "crds", "mminferenceservices.mmis.dev", "clusterkopfpeerings.kopf.dev"
    )


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_helm_lint_and_template(cluster: Cluster, values: list[str]) -> None:
    _helm(cluster, "lint", "--strict", str(CHART), *values)
    out = _helm(cluster, "template", "rel", str(CHART), *values).stdout
    kinds = {doc["kind"] for doc in yaml.safe_load_all(out) if doc}
    assert {"Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"} <= kinds


def test_chart_refuses_inconsistent_values(cluster: Cluster) -> None:
    unpeered = _helm(
        cluster, "template", "rel", str(CHART), "--set", "operator.replicas=2", check=False
    )
    assert unpeered.returncode != 0
    assert "needs peering.enabled=true" in unpeered.stderr
    typo = _helm(cluster, "template", "rel", str(CHART), "--set", "operator.replica=1", check=False)
    assert typo.returncode != 0
    assert "replica" in typo.stderr
    negative = _helm(
        cluster, "template", "rel", str(CHART), "--set", "operator.replicas=-1", check=False
    )
    assert negative.returncode != 0


def test_chart_refuses_kubernetes_older_than_1_30(cluster: Cluster) -> None:
    for version in ("1.29.9", "1.25.0", "1.20.1"):
        old = _helm(cluster, "template", "rel", str(CHART), "--kube-version", version, check=False)
        assert old.returncode != 0, version
        assert ">=1.30.0-0" in old.stderr


def test_plain_helm_template_renders(cluster: Cluster) -> None:
    """No cluster, no --kube-version: helm's offline placeholder version (v1.20.0) passes."""
    proc = subprocess.run(
        [str(cluster.bin("helm")), "template", str(CHART)],
        capture_output=True, text=True, env={**cluster.env, "KUBECONFIG": "/nonexistent"},
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    kinds = {doc["kind"] for doc in yaml.safe_load_all(proc.stdout) if doc}
    assert {"Deployment", "ClusterRole"} <= kinds


def _docs(cluster: Cluster, *values: str) -> dict[str, dict[str, Any]]:
    out = _helm(cluster, "template", "rel", str(CHART), *values).stdout
    return {doc["kind"]: doc for doc in yaml.safe_load_all(out) if doc}


def test_dashboard_and_alert_values(cluster: Cluster) -> None:
    defaults = _docs(cluster)
    board = defaults["ConfigMap"]["metadata"]
    assert board["labels"]["grafana_dashboard"] == "1"
    assert board["annotations"]["grafana_folder"] == "mmis"
    assert "PrometheusRule" not in defaults  # offline render: the cluster serves no such API
    custom = _docs(
        cluster, "--set", "dashboards.folder=Serving", "--set", "dashboards.labels.team=ml",
        "--set", "alerts.enabled=true", "--set", "alerts.labels.release=kps",
    )  # fmt: skip
    assert custom["ConfigMap"]["metadata"]["annotations"]["grafana_folder"] == "Serving"
    assert custom["ConfigMap"]["metadata"]["labels"]["team"] == "ml"
    assert custom["PrometheusRule"]["metadata"]["labels"]["release"] == "kps"
    assert custom["PrometheusRule"]["spec"]["groups"]
    off = _docs(cluster, "--set", "dashboards.enabled=false", "--set", "alerts.enabled=false")
    assert "ConfigMap" not in off and "PrometheusRule" not in off
    typo = _helm(
        cluster, "template", "rel", str(CHART), "--set", "dashboards.folders=x", check=False
    )
    assert typo.returncode != 0 and "folders" in typo.stderr


def test_template_includes_the_crd_unchanged(cluster: Cluster) -> None:
    out = _helm(cluster, "template", "rel", str(CHART), "--include-crds").stdout
    docs = [doc for doc in yaml.safe_load_all(out) if doc]
    (crd,) = [d for d in docs if d["metadata"]["name"] == "mminferenceservices.mmis.dev"]
    assert crd == yaml.safe_load((CHART / "crds" / "mminferenceservice.yaml").read_text())


@pytest.mark.parametrize("kind", VALUE_SETS)
def test_server_side_dry_run_accepts_every_rendered_manifest(
    cluster: Cluster, chart_crds: None, namespace: str, kind: str
) -> None:
    values = VALUE_SETS[kind]
    if kind == "namespaced":  # the Roles go into namespaces that must exist for a dry run
        values = ["--set", f"operator.watchNamespaces={{{namespace}}}"]
    rendered = _helm(
        cluster, "template", f"dry-{namespace}", str(CHART), "--namespace", namespace, *values
    ).stdout
    docs = [doc for doc in yaml.safe_load_all(rendered) if doc]
    assert docs
    proc = cluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-", input=rendered, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("(server dry run)") == len(docs)


@pytest.fixture
def release(cluster: Cluster, chart_crds: None, namespace: str) -> Iterator[str]:
    name = f"r{namespace[2:]}"
    _helm(
        cluster, "install", name, str(CHART), "--namespace", namespace, "--wait",
        "--timeout", "120s", "--set", f"operator.watchNamespaces={{{namespace}}}",
    )  # fmt: skip
    yield name
    _helm(cluster, "uninstall", name, "--namespace", namespace, "--wait", check=False)


def test_helm_install_brings_up_the_operator(
    cluster: Cluster, namespace: str, release: str
) -> None:
    deployment = f"deployment/{release}-mmis-operator"
    status = json.loads(cluster.kubectl("get", "-n", namespace, deployment, "-o", "json").stdout)
    assert status["status"]["availableReplicas"] == 1
    container = status["spec"]["template"]["spec"]["containers"][0]
    assert f"--namespace={namespace}" in container["args"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    cluster.kubectl("get", "crd", "mminferenceservices.mmis.dev")


def _can(cluster: Cluster, kubeconfig: Path, *args: str) -> bool:
    proc = cluster.kubectl("auth", "can-i", *args, kubeconfig=kubeconfig, check=False)
    return proc.stdout.strip() == "yes"


def test_operator_works_with_the_chart_service_account_and_nothing_more(
    cluster: Cluster, namespace: str, release: str
) -> None:
    kubeconfig = cluster.kubeconfig_for_serviceaccount(namespace, f"{release}-mmis-operator")
    options = Options(namespaces=(namespace,), resync_seconds=600.0)
    with OperatorThread(kubeconfig, options) as running:
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(SAMPLE))
        proc = kubectl_wait(
            cluster, "-n", namespace, "mmis/rbac-check", "--for=condition=Ready", timeout_s=240
        )
        assert proc.returncode == 0, cluster.kubectl(
            "get", "-n", namespace, "mmis/rbac-check", "-o", "yaml", check=False
        ).stdout
        hpa = kubectl_wait(cluster, "-n", namespace, "hpa/rbac-check", "--for=create")
        assert hpa.returncode == 0, hpa.stderr  # the chart's RBAC lets the operator make it
        policy = kubectl_wait(
            cluster, "-n", namespace, "networkpolicy/rbac-check", "--for=create"
        )  # and the resource's NetworkPolicy (networkPolicy.enabled, the default)
        assert policy.returncode == 0, policy.stderr
        cluster.kubectl(
            "delete", "-n", namespace, "mmis/rbac-check", "--timeout=180s", timeout=200
        )  # kubectl's own bound first
    assert running.error is None
    # a forbidden action is refused for real, not just absent from a list
    secrets = cluster.kubectl("get", "secrets", "-n", namespace, kubeconfig=kubeconfig, check=False)
    assert secrets.returncode != 0 and "forbidden" in secrets.stderr.lower()
    assert _can(cluster, kubeconfig, "patch", "deployments", "-n", namespace)
    assert _can(cluster, kubeconfig, "delete", "horizontalpodautoscalers.autoscaling", "-n",
                namespace)  # fmt: skip
    assert not _can(cluster, kubeconfig, "create", "pods", "-n", namespace)
    assert not _can(cluster, kubeconfig, "delete", "nodes")
    assert not _can(cluster, kubeconfig, "create", "deployments", "-n", "default")
    # installed without routing.enabled: no right on Secrets or RBAC objects at all
    assert not _can(cluster, kubeconfig, "create", "secrets", "-n", namespace)
    assert not _can(cluster, kubeconfig, "create", "rolebindings", "-n", namespace)


def test_clusterwide_rbac_grants_only_the_operator_verbs(cluster: Cluster, chart_crds: None,
                                                         namespace: str) -> None:  # fmt: skip
    name = f"c{namespace[2:]}"
    _helm(cluster, "install", name, str(CHART), "--namespace", namespace)
    try:
        kubeconfig = cluster.kubeconfig_for_serviceaccount(namespace, f"{name}-mmis-operator")
        assert _can(cluster, kubeconfig, "watch", "namespaces")
        assert _can(cluster, kubeconfig, "patch", "mminferenceservices.mmis.dev", "-n", "default")
        status = ["mminferenceservices.mmis.dev", "--subresource=status", "-A"]
        assert _can(cluster, kubeconfig, "update", *status)
        assert not _can(cluster, kubeconfig, "get", "secrets", "-A")
        assert not _can(cluster, kubeconfig, "create", "pods", "-A")
        assert not _can(cluster, kubeconfig, "update", "deployments", "-A")
        # issue 41: nothing that rewrites the cluster (kube-system's ConfigMaps, new RBAC)
        assert not _can(cluster, kubeconfig, "patch", "configmaps", "-n", "kube-system")
        assert not _can(cluster, kubeconfig, "create", "roles", "-n", "kube-system")
        assert not _can(cluster, kubeconfig, "create", "secrets", "-n", "kube-system")
        assert _can(cluster, kubeconfig, "create", "networkpolicies", "-n", namespace)
    finally:
        _helm(cluster, "uninstall", name, "--namespace", namespace, check=False)


def test_fault_injection_is_off_unless_asked_for(cluster: Cluster) -> None:
    def args(*values: str) -> list[str]:
        container = _docs(cluster, *values)["Deployment"]["spec"]["template"]["spec"]
        return list(container["containers"][0]["args"])

    assert "--allow-fault-injection" not in args()
    assert "--allow-fault-injection" in args("--set", "operator.allowFaultInjection=true")
