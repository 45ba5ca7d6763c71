"""Issue 41, item 2 (NetworkPolicies): who may reach the inference and picker pods' ports.

What an attacker did: from any pod of the cluster, connected to an engine's event ports
(5557-5560) and read every user's prompt tokens off the KV event stream and its replay, and
called the front end's operations port (8001) ``/internal/*`` routes; none of the operator's
or the chart's objects was a NetworkPolicy.

What is checked here: the NetworkPolicies the operator renders (its pure builders, fed the
settings the chart's flags give it) against the pods it renders, with a small label-selector
matcher (matchLabels + matchExpressions, namespaceSelector + podSelector peers as the
NetworkPolicy API defines them):

- ``NAME`` selects the inference pod template; its API port admits everyone;
- the ops port admits the resource's picker, the operator's own pods (the chart's labels in its
  namespace) and the scrapers; the event ports admit the picker only; a pod with other labels,
  or with the picker's labels in another namespace, is admitted to neither;
- ``NAME-epp`` selects the picker pods; gRPC from any pod, metrics from the scrapers only;
- the chart's operator policy selects the operator's pod and admits only its liveness port.

Not checked here: enforcement by a real CNI (the test node's bridge CNI enforces none); a
test on a node with an enforcing CNI is future work (docs/SECURITY.md).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/tools.py
from tools import in_ci

from mmis_operator import builders, routing
from mmis_operator import kube as r
from mmis_operator import main as operator_main
from mmis_operator.reconciler import Security
from mmis_operator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "mmis"
NS = "ml"
OPERATOR_NS = "mmis-system"
EVENT_PORTS = (5557, 5558, 5559, 5560)
RESOURCE: dict[str, Any] = {
    "apiVersion": "mmis.dev/v1alpha1",
    "kind": "MMInferenceService",
    "metadata": {"name": "llava", "namespace": NS, "uid": "uid-1"},
    "spec": {
        "model": {"id": "llava-hf/llava-1.5-7b-hf"},
        "resources": {"gpus": 1, "memory": "16Gi"},
        "cache": {"size": "2Gi"},
        "routing": {},
        # a user's extra pod labels never widen or narrow the policy's selection
        "podTemplate": {"metadata": {"labels": {"team": "vision"}}},
    },
}
# the chart's operator pod labels (mmis.selectorLabels for release "rel")
OPERATOR_LABELS = {"app.kubernetes.io/name": "mmis-operator", "app.kubernetes.io/instance": "rel"}
# what kube-prometheus-stack's Prometheus pods carry (prometheus-operator sets them)
PROMETHEUS = {
    "app.kubernetes.io/name": "prometheus",
    "app.kubernetes.io/instance": "kps-prometheus",
    "app.kubernetes.io/managed-by": "prometheus-operator",
    "prometheus": "kps-prometheus",
}


# --- a label-selector and NetworkPolicy matcher (the API's semantics) ----------------------------


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A LabelSelector against labels: every matchLabels pair and every expression; an empty
    selector selects everything."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], set(expr.get("values") or [])
        present = key in labels
        ok = {
            "In": present and labels.get(key) in values,
            "NotIn": not present or labels.get(key) not in values,
            "Exists": present,
            "DoesNotExist": not present,
        }[op]
        if not ok:
            return False
    return True


class Pod:
    """A source of traffic: its labels and namespace (with that namespace's labels)."""

    def __init__(self, labels: Mapping[str, str], namespace: str) -> None:
        self.labels = dict(labels)
        self.namespace = namespace
        # the API server labels every namespace with its name
        self.namespace_labels = {r.NAMESPACE_NAME_LABEL: namespace}


def peer_admits(peer: Mapping[str, Any], policy_namespace: str, pod: Pod) -> bool:
    """A NetworkPolicyPeer: podSelector alone means the policy's namespace; namespaceSelector
    alone every pod of the matching namespaces; both, pods matching both. ipBlock is no pod."""
    if "ipBlock" in peer:
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], pod.namespace_labels):
            return False
    elif pod.namespace != policy_namespace:
        return False
    return selects(peer.get("podSelector") or {}, pod.labels)


def admits(policy: Mapping[str, Any], port: int, pod: Pod) -> bool:
    """Whether ``policy``'s ingress rules let ``pod`` reach ``port`` (TCP) of a selected pod."""
    namespace = policy["metadata"]["namespace"]
    for rule in policy["spec"].get("ingress") or []:
        ports = rule.get("ports")
        if ports is not None and not any(
            p.get("protocol", "TCP") == "TCP" and p["port"] == port for p in ports
        ):
            continue
        peers = rule.get("from")
        if peers is None or any(peer_admits(peer, namespace, pod) for peer in peers):
            return True
    return False


def test_the_matcher_follows_the_api() -> None:
    """The matcher itself (a wrong matcher would make every check below meaningless)."""
    labels = {"a": "1", "b": "2"}
    assert selects({}, labels)
    assert selects({"matchLabels": {"a": "1"}}, labels)
    assert not selects({"matchLabels": {"a": "2"}}, labels)
    assert selects({"matchExpressions": [{"key": "b", "operator": "In", "values": ["2"]}]}, labels)
    assert not selects({"matchExpressions": [{"key": "c", "operator": "Exists"}]}, labels)
    assert selects({"matchExpressions": [{"key": "c", "operator": "DoesNotExist"}]}, labels)
    assert selects({"matchExpressions": [{"key": "c", "operator": "NotIn", "values": ["x"]}]}, {})
    here, there = Pod({"a": "1"}, "x"), Pod({"a": "1"}, "y")
    same_namespace = {"podSelector": {"matchLabels": {"a": "1"}}}
    assert peer_admits(same_namespace, "x", here) and not peer_admits(same_namespace, "x", there)
    anywhere = {"namespaceSelector": {}}
    assert peer_admits(anywhere, "x", there)
    both = {"namespaceSelector": {"matchLabels": {r.NAMESPACE_NAME_LABEL: "y"}}, **same_namespace}
    assert peer_admits(both, "x", there) and not peer_admits(both, "x", here)
    policy = {"metadata": {"namespace": "x"}, "spec": {"ingress": [{"ports": [{"port": 1}]}]}}
    assert admits(policy, 1, there) and not admits(policy, 2, there)
    assert not admits({"metadata": {"namespace": "x"}, "spec": {"ingress": []}}, 1, here)


# --- the operator's objects ----------------------------------------------------------------------


def _security(**extra: Any) -> Security:
    return Security(
        picker_cluster_role="rel-mmis-operator-picker",
        operator_namespace=OPERATOR_NS,
        operator_labels=OPERATOR_LABELS,
        **extra,
    )


def _rendered(security: Security, with_routing: bool = True) -> dict[str, dict[str, Any]]:
    """The inference Deployment and the NetworkPolicies as the reconciler builds them."""
    obj = copy.deepcopy(RESOURCE)
    if not with_routing:
        obj["spec"].pop("routing")
    spec = parse_spec(obj["spec"])
    peer = security.operator_peer()
    out = {
        "deployment": builders.deployment(obj, spec),
        "policy": builders.network_policy(obj, spec, security.scrapers, peer),
    }
    if with_routing:
        role = security.picker_cluster_role
        objects = builders.routing_objects(obj, spec, role, security.scrapers)
        by_kind = {m["kind"]: m for m in objects}
        out["picker"] = by_kind["Deployment"]
        out["picker-policy"] = by_kind["NetworkPolicy"]
    return out


def _template_labels(deployment: Mapping[str, Any]) -> dict[str, str]:
    return dict(deployment["spec"]["template"]["metadata"]["labels"])


def test_inference_policy_selects_the_inference_pods_and_the_api_port_admits_all() -> None:
    built = _rendered(_security())
    policy = built["policy"]
    assert policy["metadata"]["name"] == "llava" and policy["metadata"]["namespace"] == NS
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert selects(policy["spec"]["podSelector"], _template_labels(built["deployment"]))
    # ...and not the picker's pods (they have their own policy)
    assert not selects(policy["spec"]["podSelector"], _template_labels(built["picker"]))
    for pod in (Pod({"app": "anything"}, NS), Pod({}, "elsewhere"), Pod(PROMETHEUS, "mon")):
        assert admits(policy, r.HTTP_PORT, pod)


def test_ops_and_event_ports_admit_the_picker_and_nobody_else() -> None:
    built = _rendered(_security())
    policy = built["policy"]
    picker = Pod(_template_labels(built["picker"]), NS)
    operator = Pod(OPERATOR_LABELS, OPERATOR_NS)
    scraper = Pod(PROMETHEUS, "monitoring")
    strangers = [
        Pod({"app": "attacker"}, NS),  # same namespace, other labels
        Pod(_template_labels(built["picker"]), "other"),  # the picker's labels elsewhere
        Pod(OPERATOR_LABELS, "other"),  # the operator's labels in another namespace
        Pod(_template_labels(built["deployment"]), NS),  # another inference pod
        Pod({}, OPERATOR_NS),  # any pod of the operator's namespace
    ]
    assert admits(policy, r.OPS_PORT, picker)
    assert admits(policy, r.OPS_PORT, operator)  # the CacheCoherent probe
    assert admits(policy, r.OPS_PORT, scraper)  # /metrics
    for port in EVENT_PORTS:
        assert admits(policy, port, picker), port
        assert not admits(policy, port, operator) and not admits(policy, port, scraper), port
    assert tuple(p["containerPort"] for p in routing.engine_ports()) == EVENT_PORTS
    for pod in strangers:
        for port in (r.OPS_PORT, *EVENT_PORTS):
            assert not admits(policy, port, pod), (port, pod.labels, pod.namespace)
    # the engine's health port admits nobody (the kubelet is node traffic, always allowed)
    for pod in (picker, operator, scraper, *strangers):
        assert not admits(policy, r.ENGINE_HEALTH_PORT, pod)


def test_without_routing_no_event_port_and_no_picker_on_ops() -> None:
    built = _rendered(_security(), with_routing=False)
    policy = built["policy"]
    picker_labels = routing.picker_selector("llava")
    for port in (r.OPS_PORT, *EVENT_PORTS):
        assert not admits(policy, port, Pod(picker_labels, NS)), port
    assert admits(policy, r.OPS_PORT, Pod(OPERATOR_LABELS, OPERATOR_NS))


def test_picker_policy() -> None:
    built = _rendered(_security())
    policy = built["picker-policy"]
    assert policy["metadata"]["name"] == "llava-epp"
    assert selects(policy["spec"]["podSelector"], _template_labels(built["picker"]))
    assert not selects(policy["spec"]["podSelector"], _template_labels(built["deployment"]))
    gateway = Pod({"app": "istio-ingressgateway"}, "istio-system")
    assert admits(policy, routing.GRPC_PORT, gateway)
    assert admits(policy, routing.METRICS_PORT, Pod(PROMETHEUS, "monitoring"))
    assert not admits(policy, routing.METRICS_PORT, gateway)
    for pod in (gateway, Pod(PROMETHEUS, "monitoring"), Pod({}, NS)):
        assert not admits(policy, routing.HEALTH_PORT, pod)  # the kubelet's only


def test_scrapers_are_the_settings() -> None:
    narrow = {
        "namespaceSelector": {"matchLabels": {r.NAMESPACE_NAME_LABEL: "monitoring"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }
    policy = _rendered(_security(scrapers=narrow))["policy"]
    assert admits(policy, r.OPS_PORT, Pod(PROMETHEUS, "monitoring"))
    assert not admits(policy, r.OPS_PORT, Pod(PROMETHEUS, "team-b"))


# --- the chart: its flags give the operator these settings, its own pod's policy ------------------


def _helm() -> Path:
    tools = Path(os.environ.get("MMIS_TOOLS_DIR") or Path.home() / ".cache" / "mmis" / "tools")
    helm = tools / "bin" / "helm"
    if not helm.is_file():
        reason = f"{helm} not built: run scripts/gotools helm (or set MMIS_TOOLS_DIR)"
        if in_ci():
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return helm


def _render(*values: str) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [str(_helm()), "template", "rel", str(CHART), "--namespace", OPERATOR_NS,
         "--kube-version", "1.33.0", *values],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def _operator_options(docs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> Any:
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = dep["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    monkeypatch.setenv("POD_NAMESPACE", OPERATOR_NS)  # what the downward API gives it
    parser = argparse.ArgumentParser()
    operator_main.add_arguments(parser)
    return operator_main.options_from_args(parser.parse_args(container["args"])), pod


def test_the_charts_operator_is_admitted_to_ops_and_its_own_pod_to_liveness_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docs = _render("--set", "routing.enabled=true")
    options, pod = _operator_options(docs, monkeypatch)
    security = options.security()
    assert security.network_policies and security.scrapers == r.DEFAULT_SCRAPERS
    policy = _rendered(security)["policy"]
    assert admits(policy, r.OPS_PORT, Pod(pod["metadata"]["labels"], OPERATOR_NS))
    assert not admits(policy, r.OPS_PORT, Pod(pod["metadata"]["labels"], "elsewhere"))
    # the chart's policy for the operator's own pod: its liveness port, nothing else
    (own,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert selects(own["spec"]["podSelector"], pod["metadata"]["labels"])
    assert own["spec"]["policyTypes"] == ["Ingress"]
    liveness = pod["spec"]["containers"][0]["ports"][0]["containerPort"]
    anyone = Pod({}, "elsewhere")
    assert admits(own, liveness, anyone)
    assert not any(admits(own, port, anyone) for port in (80, 443, 8000, 8001, 9443))
    # networkPolicy.enabled=false: the operator is told, and the chart renders none
    off = _render("--set", "networkPolicy.enabled=false")
    assert not [d for d in off if d["kind"] == "NetworkPolicy"]
    assert _operator_options(off, monkeypatch)[0].security().network_policies is False


def test_chart_scrapers_value_reaches_the_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    scrapers = {
        "namespaceSelector": {"matchLabels": {"team": "obs"}},
        "podSelector": {"matchLabels": {"app": "vm-agent"}},
    }
    # helm merges values into the defaults: the default pod label is dropped with a null
    value = copy.deepcopy(scrapers)
    value["podSelector"]["matchLabels"]["app.kubernetes.io/name"] = None
    docs = _render("--set-json", f"networkPolicy.scrapers={json.dumps(value)}")
    options, _ = _operator_options(docs, monkeypatch)
    assert options.security().scrapers == scrapers
