"""``spec.routing`` (routing.py): the pure builders of the InferencePool and the endpoint
picker, the engine's event flags and the internal token's wiring, and what a spec without
routing still builds (byte for byte golden/children_without_routing.json: what the operator
built before routing existed, changed since only by intent — see its ``_note``).
The reconciler's side (discovery, the Routing condition, deletion) is tested in
test_routing_reconcile.py; the real API server in tests/kube/test_routing_mmis.py.

Regenerate the golden file (only for an intended change of those manifests; review the diff
and say in the commit what changed): ``.venv/bin/python tests/operator/test_routing.py
--write-golden NOTE``, NOTE being what changed and why (appended to ``_note``).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from mmis_operator import builders, routing
from mmis_operator import kube as r
from mmis_operator.spec import (
    MAX_CACHE_WEIGHT,
    PICKER_MAX_REPLICAS,
    InvalidSpecError,
    RoutingSpec,
    default_image,
    parse_spec,
)

GOLDEN = Path(__file__).resolve().parent / "golden" / "children_without_routing.json"
CRD = Path(__file__).resolve().parents[2] / "crds" / "mminferenceservice.yaml"
CASES: dict[str, dict[str, Any]] = json.loads(GOLDEN.read_text())["cases"]
EVENT_PORTS = {"kv-events": 5557, "kv-replay": 5558, "mm-events": 5559, "mm-replay": 5560}


ROLE = "rel-mmis-operator-picker"  # the chart's picker ClusterRole (--picker-cluster-role)


def _bytes(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode()


def write_golden(note: str) -> None:
    """Rewrite the golden children from today's builders (same resources), ``note`` appended."""
    data = json.loads(GOLDEN.read_text())
    for case in data["cases"].values():
        body = case["resource"]
        spec = parse_spec(body["spec"])
        case["deployment"] = builders.deployment(body, spec)
        case["service"] = builders.service(body, spec)
    data["_note"] = f"{data['_note']} {note}"
    GOLDEN.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def _routed(sample: dict[str, Any], **routing_spec: Any) -> dict[str, Any]:
    obj = copy.deepcopy(sample)
    obj["spec"]["routing"] = routing_spec
    return obj


def _objects(obj: dict[str, Any], scrapers: Any = None) -> dict[str, dict[str, Any]]:
    built = builders.routing_objects(obj, parse_spec(obj["spec"]), ROLE, scrapers)
    by_kind = {m["kind"]: m for m in built}
    assert len(by_kind) == len(built)  # one of each kind
    return by_kind


def _containers(dep: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in dep["spec"]["template"]["spec"]["containers"]}


@pytest.mark.parametrize("case", sorted(CASES))
def test_without_routing_the_children_are_byte_identical_to_before(case: str) -> None:
    body = CASES[case]["resource"]
    spec = parse_spec(body["spec"])
    assert spec.routing is None
    assert _bytes(builders.deployment(body, spec)) == _bytes(CASES[case]["deployment"])
    assert _bytes(builders.service(body, spec)) == _bytes(CASES[case]["service"])
    assert builders.routing_objects(body, spec, ROLE) == []


def test_routing_adds_only_the_engine_event_flags_ports_and_the_token() -> None:
    golden = CASES["sample"]
    body = _routed(golden["resource"])
    dep = builders.deployment(body, parse_spec(body["spec"]))
    engine = _containers(dep)[r.ENGINE]
    flags = routing.engine_event_args(routing.EventPorts())
    assert engine["args"][-len(flags) :] == flags
    assert flags == [
        "--kv-events-endpoint", "tcp://*:5557", "--kv-events-replay-endpoint", "tcp://*:5558",
        "--mm-events-endpoint", "tcp://*:5559", "--mm-events-replay-endpoint", "tcp://*:5560",
    ]  # fmt: skip
    named = {p["name"]: p["containerPort"] for p in engine["ports"]}
    assert named == {r.ENGINE_HEALTH_PORT_NAME: r.ENGINE_HEALTH_PORT, **EVENT_PORTS}
    # the internal token, from the Secret NAME-internal, never a value
    token = {"secretKeyRef": {"name": "llava-internal", "key": "token"}}
    front = _containers(dep)[r.FRONTEND]
    assert front["env"][-1] == {"name": "MMIS_FRONTEND_INTERNAL_TOKEN", "valueFrom": token}
    assert engine["env"][-1] == {"name": "MMIS_ENGINE_EVENTS_TOKEN", "valueFrom": token}
    # remove exactly those and what is left is the manifest without routing
    del engine["args"][-len(flags) :]
    engine["ports"] = engine["ports"][:1]
    del front["env"][-1], engine["env"][-1]
    assert _bytes(dep) == _bytes(golden["deployment"])


def test_token_secret_is_opaque_and_owned(sample: dict[str, Any]) -> None:
    secret = builders.token_secret(_routed(sample), "ab" * 32)
    assert (secret["apiVersion"], secret["kind"], secret["type"]) == ("v1", "Secret", "Opaque")
    assert secret["stringData"] == {"token": "ab" * 32}
    meta = secret["metadata"]
    assert (meta["name"], meta["namespace"]) == ("llava-internal", "ml")
    (owner,) = meta["ownerReferences"]
    assert (owner["uid"], owner["controller"]) == ("uid-1", True)


def test_parse_routing_defaults_and_refusals(sample: dict[str, Any]) -> None:
    spec = parse_spec(_routed(sample)["spec"])
    assert spec.routing == RoutingSpec(
        image=default_image(), replicas=1, cache_weight=routing.CACHE_WEIGHT
    )
    assert default_image() == "ghcr.io/mmis-dev/mmis-epp:0.1.0"  # the operator's version
    custom = parse_spec(_routed(sample, picker={"image": "reg/epp:x", "replicas": 2})["spec"])
    assert custom.routing is not None
    assert (custom.routing.image, custom.routing.replicas) == ("reg/epp:x", 2)
    bad = {
        "spec.routing": "on",
        "spec.routing.picker": {"picker": "big"},
        "spec.routing.picker.replicas": {"picker": {"replicas": 0}},
        "spec.routing.cacheWeight": {"cacheWeight": True},
        "spec.routing.picker.image": {"picker": {"image": 7}},
    }
    for field, value in bad.items():
        obj = copy.deepcopy(sample)
        obj["spec"]["routing"] = value
        with pytest.raises(InvalidSpecError, match=field.replace(".", r"\.")):
            parse_spec(obj["spec"])
    sample["spec"]["routing"] = None  # null is absent
    assert parse_spec(sample["spec"]).routing is None


def test_routing_objects_are_owned_and_in_apply_order(sample: dict[str, Any]) -> None:
    obj = _routed(sample)
    built = builders.routing_objects(obj, parse_spec(obj["spec"]), ROLE)
    kinds = [m["kind"] for m in built]
    assert kinds == ["ServiceAccount", "RoleBinding", "Deployment", "Service", "InferencePool"]
    refs = routing.object_refs("llava")
    assert [(m["apiVersion"], m["kind"], m["metadata"]["name"]) for m in built] == [
        ref for ref in refs if ref[1] != "NetworkPolicy"
    ]
    # with NetworkPolicies, the picker's comes before the picker
    policed = builders.routing_objects(obj, parse_spec(obj["spec"]), ROLE, r.DEFAULT_SCRAPERS)
    assert [(m["apiVersion"], m["kind"], m["metadata"]["name"]) for m in policed] == refs
    for manifest in built:
        meta = manifest["metadata"]
        assert meta["namespace"] == "ml"
        (owner,) = meta["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
            r.KIND, "llava", "uid-1", True,
        )  # fmt: skip


def test_inference_pool_selects_the_inference_pods_on_http() -> None:
    body = _routed(CASES["sample"]["resource"])
    pool = _objects(body)["InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["name"] == "llava"
    dep = builders.deployment(body, parse_spec(body["spec"]))
    assert pool["spec"] == {
        "selector": {"matchLabels": dep["spec"]["selector"]["matchLabels"]},
        "targetPorts": [{"number": 8000}],
        # FailOpen: a dead picker leaves the gateway balancing over the pods by itself
        "endpointPickerRef": {
            "name": "llava-epp", "port": {"number": 9002}, "failureMode": "FailOpen",
        },
    }  # fmt: skip
    assert pool["spec"]["selector"]["matchLabels"] == r.selector_labels("llava")


def test_picker_deployment(sample: dict[str, Any]) -> None:
    objects = _objects(_routed(sample))
    dep = objects["Deployment"]
    assert dep["metadata"]["name"] == "llava-epp"
    assert dep["spec"]["replicas"] == 1
    (epp,) = dep["spec"]["template"]["spec"]["containers"]
    assert epp["image"] == default_image()
    assert epp["args"] == [
        "--pool-name", "llava", "--pool-namespace", "ml",
        "--pool-group", "inference.networking.k8s.io",
        "--config-text", routing.render(routing.picker_config(ops_port=8001)),
        "--grpc-port", "9002",
        "--grpc-health-port", "9003", "--metrics-port", "9090",
        "--model-server-metrics-port", "8001",
        "--metrics-endpoint-auth=false", "--tracing=false",
    ]  # fmt: skip
    probe = {"port": 9003, "service": "inference-extension"}
    assert epp["readinessProbe"]["grpc"] == epp["livenessProbe"]["grpc"] == probe
    assert {p["name"]: p["containerPort"] for p in epp["ports"]} == {
        "grpc": 9002, "grpc-health": 9003, "metrics": 9090,
    }  # fmt: skip
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "llava-epp"
    # no ConfigMap: the configuration is the argument
    assert [v["name"] for v in pod["volumes"]] == ["tmp"]
    token = {"secretKeyRef": {"name": "llava-internal", "key": "token"}}
    assert {"name": "MMIS_INTERNAL_TOKEN", "valueFrom": token} in epp["env"]


def test_picker_pod_is_pod_security_restricted(sample: dict[str, Any]) -> None:
    pod = _objects(_routed(sample))["Deployment"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in pod["containers"]:
        ctx = container["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False
        assert ctx["readOnlyRootFilesystem"] is True
        assert ctx["runAsNonRoot"] is True
        assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert all("hostPath" not in v for v in pod["volumes"])


def test_picker_pods_are_never_taken_for_inference_pods(sample: dict[str, Any]) -> None:
    objects = _objects(_routed(sample))
    selector = r.selector_labels("llava")
    for kind in ("Deployment", "ServiceAccount", "RoleBinding", "Service"):
        # the operator's Deployment and pod watchers find owners by mmis.dev/service
        assert r.LABEL_SERVICE not in objects[kind]["metadata"]["labels"], kind
    template_labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= template_labels.items()  # not in the Service or the pool
    assert r.LABEL_SERVICE not in template_labels
    service = objects["Service"]
    assert service["spec"]["selector"] == objects["Deployment"]["spec"]["selector"]["matchLabels"]
    assert service["spec"]["selector"].items() <= template_labels.items()
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        "grpc": (9002, "grpc"), "metrics": (9090, "metrics"),
    }  # fmt: skip


def _config_text(objects: dict[str, dict[str, Any]]) -> str:
    (epp,) = objects["Deployment"]["spec"]["template"]["spec"]["containers"]
    return str(epp["args"][epp["args"].index("--config-text") + 1])


def test_config_text_is_the_picker_config_with_the_spec_weight(sample: dict[str, Any]) -> None:
    default = _objects(_routed(sample))
    assert _config_text(default) == routing.render(routing.picker_config(ops_port=8001))
    heavy = _objects(_routed(sample, cacheWeight=7))
    text = _config_text(heavy)
    assert text == routing.render(routing.picker_config(ops_port=8001, cache_weight=7))
    # a new configuration is a new pod template: the picker restarts with it
    templates = [objs["Deployment"]["spec"]["template"] for objs in (default, heavy)]
    assert templates[0] != templates[1]


@pytest.mark.parametrize("cache_weight", [0, routing.CACHE_WEIGHT, MAX_CACHE_WEIGHT])
def test_a_lora_holder_outweighs_every_other_scorer_together(cache_weight: int) -> None:
    """The framework's LoRA-affinity scorer reads P0's ``mmis:lora_requests_info`` (the
    catalog's name and labels) and weighs more than every other scorer together, each score
    being in [0, 1]: a pod holding the request's adapter (1) beats any that does not (0)."""
    from mmis.telemetry import catalog

    config = routing.picker_config(ops_port=8001, cache_weight=cache_weight)
    plugins = {p["type"]: p.get("parameters") for p in config["plugins"]}
    (engine,) = plugins["core-metrics-extractor"]["engineConfigs"]
    assert engine["loraSpec"] == catalog.LORA_INFO.name
    # the labels the framework's extractor reads (extractor/metrics: LoraInfo*MetricName)
    assert catalog.LORA_INFO.labels[1:] == (
        "running_lora_adapters", "waiting_lora_adapters", "max_lora"
    )  # fmt: skip
    assert routing.LORA_SCORER in plugins
    (profile,) = config["schedulingProfiles"]
    weights = {p["pluginRef"]: p["weight"] for p in profile["plugins"] if "weight" in p}
    lora = weights.pop(routing.LORA_SCORER)
    assert weights == {routing.CACHE_SCORER: cache_weight, **dict.fromkeys(routing.LOAD_SCORERS, 1)}
    assert lora >= sum(weights.values()) + 1


def test_rbac_binds_the_charts_picker_role_in_the_namespace(sample: dict[str, Any]) -> None:
    objects = _objects(_routed(sample))
    assert "Role" not in objects  # the operator grants nothing it would have to hold
    binding = objects["RoleBinding"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ROLE,
    }  # fmt: skip
    assert binding["metadata"]["namespace"] == "ml"  # a RoleBinding: this namespace only
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "llava-epp", "namespace": "ml"}
    ]
    assert objects["ServiceAccount"]["metadata"]["name"] == "llava-epp"


def test_several_pickers_elect_a_leader(sample: dict[str, Any]) -> None:
    objects = _objects(_routed(sample, picker={"replicas": 2}))
    dep = objects["Deployment"]
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    (epp,) = dep["spec"]["template"]["spec"]["containers"]
    assert "--ha-enable-leader-election" in epp["args"]
    assert epp["readinessProbe"]["grpc"]["service"] == "readiness"
    assert epp["livenessProbe"]["grpc"]["service"] == "liveness"
    # the chart's picker ClusterRole holds the leader election's rights
    groups = {g for rule in routing.PICKER_RULES for g in rule["apiGroups"]}
    assert "coordination.k8s.io" in groups


def test_crd_schema_of_routing_matches_the_parser() -> None:
    crd = yaml.safe_load(CRD.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    section = spec["properties"]["routing"]
    # no default: a resource without routing must stay without it (no picker, no pod flags)
    assert "default" not in section and "routing" not in spec.get("required", [])
    picker = section["properties"]["picker"]["properties"]
    # the image's default follows the operator's version, so the CRD stores none
    assert "default" not in picker["image"]
    assert (picker["replicas"]["minimum"], picker["replicas"]["maximum"]) == (
        1, PICKER_MAX_REPLICAS,
    )  # fmt: skip
    weight = section["properties"]["cacheWeight"]
    assert (weight["minimum"], weight["maximum"]) == (0, MAX_CACHE_WEIGHT)
    for field in (section, picker["image"], picker["replicas"], weight):
        assert field["description"]


def test_picker_network_policy(sample: dict[str, Any]) -> None:
    scrapers = {"namespaceSelector": {"matchLabels": {"team": "obs"}}, "podSelector": {}}
    policy = _objects(_routed(sample), scrapers)["NetworkPolicy"]
    assert policy["metadata"]["name"] == "llava-epp"
    assert policy["spec"]["podSelector"] == {"matchLabels": routing.picker_selector("llava")}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    rules = {rule["ports"][0]["port"]: rule["from"] for rule in policy["spec"]["ingress"]}
    # gRPC from any pod of the cluster (the gateway), metrics from the scrapers; the health
    # port 9003 has no rule (the kubelet's probes are node traffic, always allowed)
    assert rules == {9002: [{"namespaceSelector": {}}], 9090: [scrapers]}
    assert "NetworkPolicy" not in _objects(_routed(sample))  # policies off


if __name__ == "__main__":  # pragma: no cover
    if len(sys.argv) != 3 or sys.argv[1] != "--write-golden":
        sys.exit("usage: test_routing.py --write-golden NOTE")
    write_golden(sys.argv[2])
