"""Autoscaling and scraping against the real control plane (issue 12 items 7 and 8).

- HPA: the operator creates an ``autoscaling/v2`` HorizontalPodAutoscaler on the resource's
  scale subresource, updates it, deletes it when autoscaling is switched off, and garbage
  collection deletes it with the resource. The real kube-controller-manager's HPA controller
  reads the scale subresource (``AbleToScale`` True; ``status.selector`` is what it lists pods
  by). A scale through the subresource (what the HPA does) reaches the Deployment and survives
  a re-apply of a manifest without ``spec.replicas``.
- KEDA and prometheus-operator: with minimal test-only CRDs for ``ScaledObject`` and
  ``PodMonitor`` (schema-less; written here, nothing copied), discovery makes the operator
  create a ScaledObject instead of an HPA, and a PodMonitor; each is deleted when the spec
  stops asking for it. The CRDs are removed afterwards, so other tests see a bare cluster.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import operator_kit as ok
import pytest
import yaml
from kubecluster import Cluster, apply_crds

from mmis_operator import reconciler
from mmis_operator.main import OperatorThread

pytestmark = pytest.mark.controlplane

AUTO = {"enabled": True, "minReplicas": 1, "maxReplicas": 3, "target": 4}
SAMPLE: dict[str, Any] = {
    "apiVersion": "mmis.dev/v1alpha1",
    "kind": "MMInferenceService",
    "metadata": {"name": "vlm"},
    "spec": {  # no replicas: the autoscaler owns them
        "model": {"id": "llava-hf/llava-1.5-7b-hf"},
        "resources": {"gpus": 1, "memory": "8Gi", "cpu": "1", "frontendCpu": "500m"},
        "cache": {"size": "1Gi"},
        "probes": {"startupTimeoutSeconds": 600, "drainSeconds": 0},
        "autoscaling": AUTO,
    },
}
HPA = "horizontalpodautoscalers.autoscaling/vlm"
SCALED_OBJECT = "scaledobjects.keda.sh/vlm"
POD_MONITOR = "podmonitors.monitoring.coreos.com/vlm"


def _test_crd(group: str, version: str, kind: str, plural: str) -> dict[str, Any]:
    """A schema-less CRD with the real group, version and names (test-only)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "listKind": f"{kind}List"},
            "versions": [{
                "name": version, "served": True, "storage": True,
                "schema": {"openAPIV3Schema": {
                    "type": "object", "x-kubernetes-preserve-unknown-fields": True}},
            }],
        },
    }  # fmt: skip


TEST_CRDS = [
    _test_crd("keda.sh", "v1alpha1", "ScaledObject", "scaledobjects"),
    _test_crd("monitoring.coreos.com", "v1", "PodMonitor", "podmonitors"),
]


def _operator(cluster: Cluster, namespace: str) -> OperatorThread:
    return OperatorThread(cluster.kubeconfig, ok.options(namespace))


def _sample(**auto: Any) -> dict[str, Any]:
    obj = copy.deepcopy(SAMPLE)
    obj["spec"]["autoscaling"].update(auto)
    return obj


def _owned_by_the_resource(obj: dict[str, Any], cluster: Cluster, namespace: str) -> None:
    uid = ok.get(cluster, namespace, "mmis/vlm")["metadata"]["uid"]
    (ref,) = obj["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
        "MMInferenceService", "vlm", uid, True,
    )  # fmt: skip


def test_hpa_follows_the_resource_and_the_hpa_controller_reads_its_scale(
    cluster: Cluster, crd: None, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(reconciler.ENV_AUTOSCALER, "hpa")  # whatever another test installed
    with _operator(cluster, namespace) as running:
        ok.apply(cluster, namespace, SAMPLE)
        ok.wait(cluster, namespace, HPA, "--for=create")
        hpa = ok.get(cluster, namespace, HPA)
        _owned_by_the_resource(hpa, cluster, namespace)
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "mmis.dev/v1alpha1", "kind": "MMInferenceService", "name": "vlm",
        }  # fmt: skip
        metric = hpa["spec"]["metrics"][0]["pods"]
        assert metric["metric"]["name"] == "mmis:num_requests_waiting"
        # the real HPA controller got the scale subresource (selector from status.selector)
        ok.wait(
            cluster, namespace, HPA,
            '--for=jsonpath={.status.conditions[?(@.type=="AbleToScale")].status}=True',
        )  # fmt: skip
        scale = json.loads(
            cluster.kubectl(
                "get", "-n", namespace, "mmis/vlm", "--subresource=scale", "-o", "json"
            ).stdout
        )
        assert scale["status"]["selector"] == "app.kubernetes.io/instance=vlm," \
            "app.kubernetes.io/name=mmis,mmis.dev/service=vlm"  # fmt: skip
        pods = ok.get(cluster, namespace, "deploy/vlm")["spec"]["template"]["metadata"]
        assert pods["annotations"]["prometheus.io/port"] == "8001"

        # the HPA's way of scaling: the resource's scale subresource; the operator follows
        cluster.kubectl("scale", "-n", namespace, "mmis/vlm", "--replicas=2")
        ok.wait(cluster, namespace, "deploy/vlm", "--for=jsonpath={.spec.replicas}=2")
        ok.apply(cluster, namespace, _sample(maxReplicas=5))  # an update, without spec.replicas
        ok.wait(cluster, namespace, HPA, "--for=jsonpath={.spec.maxReplicas}=5")
        assert ok.get(cluster, namespace, "mmis/vlm")["spec"]["replicas"] == 2  # not reset
        assert ok.get(cluster, namespace, "deploy/vlm")["spec"]["replicas"] == 2

        ok.apply(cluster, namespace, _sample(enabled=False))  # switched off: the HPA goes
        ok.wait(cluster, namespace, HPA, "--for=delete")
        ok.apply(cluster, namespace, SAMPLE)
        ok.wait(cluster, namespace, HPA, "--for=create")
        cluster.kubectl("delete", "-n", namespace, "mmis/vlm", "--wait=false")
        ok.wait(cluster, namespace, HPA, "--for=delete")  # garbage collection (owner reference)
    assert running.error is None, f"the operator died: {running.error!r}"


@pytest.fixture
def third_party_crds(cluster: Cluster, tmp_path: Path) -> Iterator[None]:
    path = tmp_path / "test-crds.yaml"
    path.write_text(yaml.safe_dump_all(TEST_CRDS))
    names = [c["metadata"]["name"] for c in TEST_CRDS]
    apply_crds(cluster, path, *names)
    yield
    cluster.kubectl("delete", "crd", *names, "--ignore-not-found", "--timeout=120s")


def test_keda_scaled_object_and_pod_monitor_when_their_crds_are_served(
    cluster: Cluster,
    crd: None,
    namespace: str,
    third_party_crds: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(reconciler.ENV_AUTOSCALER, raising=False)
    monkeypatch.delenv(reconciler.ENV_POD_MONITORS, raising=False)
    with _operator(cluster, namespace) as running:
        ok.apply(cluster, namespace, SAMPLE)
        ok.wait(cluster, namespace, SCALED_OBJECT, "--for=create")
        ok.wait(cluster, namespace, POD_MONITOR, "--for=create")
        scaled = ok.get(cluster, namespace, SCALED_OBJECT)
        _owned_by_the_resource(scaled, cluster, namespace)
        assert scaled["spec"]["scaleTargetRef"]["kind"] == "MMInferenceService"
        (trigger,) = scaled["spec"]["triggers"]
        assert trigger["type"] == "prometheus"
        assert f'namespace="{namespace}"' in trigger["metadata"]["query"]
        assert trigger["metadata"]["threshold"] == "4"
        monitor = ok.get(cluster, namespace, POD_MONITOR)
        _owned_by_the_resource(monitor, cluster, namespace)
        assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "ops"
        assert monitor["spec"]["selector"]["matchLabels"]["mmis.dev/service"] == "vlm"
        hpas = ok.get(cluster, namespace, "horizontalpodautoscalers.autoscaling")["items"]
        assert hpas == []  # KEDA makes its own

        ok.apply(cluster, namespace, _sample(target=0.5))
        ok.wait(
            cluster, namespace, SCALED_OBJECT,
            "--for=jsonpath={.spec.triggers[0].metadata.threshold}=0.5",
        )  # fmt: skip
        off = _sample(enabled=False)
        off["spec"]["monitoring"] = {"podMonitor": False}
        ok.apply(cluster, namespace, off)
        ok.wait(cluster, namespace, SCALED_OBJECT, "--for=delete")
        ok.wait(cluster, namespace, POD_MONITOR, "--for=delete")
    assert running.error is None, f"the operator died: {running.error!r}"


@pytest.mark.parametrize(
    ("auto", "message"),
    [
        ({"enabled": True, "target": 4}, "enabled needs maxReplicas and target"),
        ({**AUTO, "minReplicas": 5}, "minReplicas must not exceed maxReplicas"),
        ({**AUTO, "metric": "mmis:kv_cache_usage_perc", "target": 80}, "a fraction in [0, 1]"),
        ({**AUTO, "target": 0}, "target must be positive"),
        ({**AUTO, "metric": "vllm:num_requests_waiting"}, "spec.autoscaling.metric must be one of"),
    ],
)
def test_the_api_server_refuses_a_bad_autoscaling_spec(
    cluster: Cluster, crd: None, namespace: str, auto: dict[str, Any], message: str
) -> None:
    obj = copy.deepcopy(SAMPLE)
    obj["spec"]["autoscaling"] = auto
    proc = cluster.kubectl(
        "create", "--dry-run=server", "-n", namespace, "-f", "-",
        input=json.dumps(obj), check=False,
    )  # fmt: skip
    assert proc.returncode != 0, proc.stdout
    assert message in proc.stderr
