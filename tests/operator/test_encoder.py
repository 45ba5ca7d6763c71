"""``spec.encoder`` (issue 46 item 5, the operator's side): encoder pods beside the inference
pods, the front ends wired to them, and nothing else of the pod changed.

- Unset: nothing encoder-related is built and the inference pods are byte for byte
  golden/children_without_routing.json (test_routing.py checks those bytes; here, that
  ``spec.encoder`` absent builds no encoder object and no flag).
- Set: byte for byte golden/children_encoder.json (the PD Deployment and Service, and the
  encoder Deployment, headless Service, PodMonitor, NetworkPolicy and autoscaler); against the
  pod without it, only the front end's ``--encoder-service`` and ``MMIS_ENCODER_TOKEN`` differ.
- The reconciler applies them (with the operator installed with ``encoder.enabled``), says so
  in the ``Encoders`` condition, and deletes them when ``spec.encoder`` goes; without the
  setting it refuses ``spec.encoder`` and builds plain pods (conftest.FakeKube).
- The probe's encoder fallbacks per minute, from real HTTP answers of ``/metrics``.

The real API server's schema and CEL rules: tests/kube/test_crd_encoder_mmis.py.

Regenerate the golden file (only for an intended change; review the diff and say in the commit
what changed): ``.venv/bin/python tests/operator/test_encoder.py --write-golden NOTE``.
"""

from __future__ import annotations

import argparse
import copy
import http.server
import json
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from mmis_operator import builders, encoder, main, status
from mmis_operator import kube as r
from mmis_operator.kube import object_path
from mmis_operator.probe import OVERRIDE_ANNOTATION, CoherenceProbe
from mmis_operator.reconciler import Integrations, Reconciler, Security
from mmis_operator.spec import ENCODER_QUEUE, InvalidSpecError, parse_spec

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden" / "children_encoder.json"
CRD = ROOT / "crds" / "mminferenceservice.yaml"
GI = 2**30
# how each golden case's encoder objects were built: (autoscaler kind, PodMonitors, scrapers)
BUILD = ("HorizontalPodAutoscaler", True, r.DEFAULT_SCRAPERS)


def _bytes(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode()


def _children(resource: dict[str, Any], kind: str) -> dict[str, Any]:
    spec = parse_spec(resource["spec"])
    built = encoder.manifests(resource, spec, kind, BUILD[1], BUILD[2])
    return {
        "deployment": builders.deployment(resource, spec),
        "service": builders.service(resource, spec),
        "encoder": {k: v for k, v in built.items() if v is not None},
    }


def _cases() -> dict[str, dict[str, Any]]:
    return dict(json.loads(GOLDEN.read_text())["cases"])


def write_golden(note: str) -> None:
    """Rewrite the golden children from today's builders (same resources), ``note`` appended."""
    data = json.loads(GOLDEN.read_text())
    for case in data["cases"].values():
        case.update(_children(case["resource"], case["autoscaler"]))
    data["_note"] = f"{data['_note']} {note}".strip()
    GOLDEN.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("case", sorted(_cases()))
def test_children_are_byte_identical_to_the_golden_file(case: str) -> None:
    golden = _cases()[case]
    built = _children(golden["resource"], golden["autoscaler"])
    for key in ("deployment", "service", "encoder"):
        assert _bytes(built[key]) == _bytes(golden[key]), f"{case}: {key}"


def test_without_encoder_nothing_is_built(sample: dict[str, Any]) -> None:
    spec = parse_spec(sample["spec"])
    assert spec.encoder is None
    assert set(encoder.manifests(sample, spec, "ScaledObject", True, {}).values()) == {None}
    dep = json.dumps(builders.deployment(sample, spec))
    assert "encoder" not in dep and "ENCODER" not in dep


def _front(dep: dict[str, Any]) -> dict[str, Any]:
    (front,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == r.FRONTEND]
    return dict(front)


def test_the_pd_pod_gains_only_the_encoder_service_and_the_token(sample: dict[str, Any]) -> None:
    plain = builders.deployment(sample, parse_spec(sample["spec"]))
    with_encoder = copy.deepcopy(sample)
    with_encoder["spec"]["encoder"] = {"replicas": 3}
    dep = builders.deployment(with_encoder, parse_spec(with_encoder["spec"]))
    front, before = _front(dep), _front(plain)
    assert front["args"] == [*before["args"], "--encoder-service", "llava-encoder.ml.svc:5580"]
    token = {
        "name": "MMIS_ENCODER_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "llava-internal", "key": "token"}},
    }
    assert front["env"] == [*before["env"], token]
    # everything else of the pod, the engine included, is as without spec.encoder
    for container in (front, before):
        container.pop("args"), container.pop("env")
    assert front == before
    dep["spec"]["template"]["spec"]["containers"][0] = plain["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert _bytes(dep) == _bytes(plain)


def test_encoder_pods_are_never_taken_for_inference_pods(sample: dict[str, Any]) -> None:
    sample["spec"]["encoder"] = {}
    spec = parse_spec(sample["spec"])
    built = encoder.manifests(sample, spec, "", True, r.DEFAULT_SCRAPERS)
    pod_labels = built["Deployment"]["spec"]["template"]["metadata"]["labels"]  # type: ignore[index]
    inference = r.selector_labels("llava")
    assert r.LABEL_SERVICE not in pod_labels  # the watchers' and the status' owner label
    assert not inference.items() <= pod_labels.items()  # no inference selector matches them
    for kind, manifest in built.items():
        if manifest is None:
            continue
        assert manifest["metadata"]["name"] == "llava-encoder", kind
        assert r.LABEL_SERVICE not in manifest["metadata"]["labels"], kind
        (owner,) = manifest["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == (r.KIND, "uid-1", True)
    # the headless Service, the PodMonitor and the policy select exactly the encoder pods
    assert built["Service"]["spec"]["clusterIP"] == "None"  # type: ignore[index]
    for kind in ("Service", "PodMonitor", "NetworkPolicy"):
        manifest = built[kind]
        assert manifest is not None
        chosen = manifest["spec"].get("selector") or manifest["spec"]["podSelector"]
        chosen = chosen.get("matchLabels", chosen)
        assert chosen == encoder.selector("llava") and chosen.items() <= pod_labels.items(), kind


def test_network_policy_admits_the_encoder_port_only_from_this_services_pd_pods(
    sample: dict[str, Any],
) -> None:
    scrapers = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}}}
    policy = encoder.network_policy(sample, scrapers)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    rules = {
        tuple(p["port"] for p in rule["ports"]): rule["from"] for rule in policy["spec"]["ingress"]
    }
    assert rules == {
        (r.ENCODER_PORT,): [{"podSelector": {"matchLabels": r.selector_labels("llava")}}],
        (r.ENCODER_HEALTH_PORT,): [scrapers],
    }
    # the encoder container's ports are exactly those two, named as the policy's peers use them
    sample["spec"]["encoder"] = {}
    spec = parse_spec(sample["spec"])
    assert spec.encoder is not None
    dep = encoder.deployment(sample, spec, spec.encoder)
    (box,) = dep["spec"]["template"]["spec"]["containers"]
    assert {p["containerPort"] for p in box["ports"]} == {r.ENCODER_PORT, r.ENCODER_HEALTH_PORT}
    # the inference pods' own policy is the same with or without encoders (ingress only: the
    # front ends' connections to the encoders are egress, which it does not restrict)
    plain = builders.network_policy(sample, parse_spec({**sample["spec"], "encoder": None}), {})
    assert builders.network_policy(sample, parse_spec(sample["spec"]), {}) == plain


def test_encoder_container_runs_mmis_encoder_on_the_engines_model(sample: dict[str, Any]) -> None:
    sample["spec"]["model"]["revision"] = "abc123"
    sample["spec"]["encoder"] = {"resources": {"cpu": "3", "memory": "6Gi"}}
    spec = parse_spec(sample["spec"])
    assert spec.encoder is not None
    dep = encoder.deployment(sample, spec, spec.encoder)
    pod = dep["spec"]["template"]["spec"]
    (box,) = pod["containers"]
    assert box["args"] == [
        "encoder", "--model", "llava-hf/llava-1.5-7b-hf", "--revision", "abc123",
        "--endpoint", "tcp://0.0.0.0:5580", "--health-port", "8003",
    ]  # fmt: skip
    engine = builders.engine_container(spec, "llava")
    # the same model cache and download as the engine (the same snapshot, offline)
    assert pod["initContainers"] == [builders.download_container(spec, "llava")]
    assert builders.model_cache_volume(spec, "llava") in pod["volumes"]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in box["env"]
    assert {m["mountPath"] for m in box["volumeMounts"]} == {"/tmp", builders.CACHE_DIR}
    # the token only by reference; GPUs follow the PD pods' (1 for a GPU pool)
    assert {
        "name": "MMIS_ENCODER_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "llava-internal", "key": "token"}},
    } in box["env"]
    assert box["resources"] == {
        "requests": {"cpu": "3", "memory": "6Gi", "ephemeral-storage": "50Gi"},
        "limits": {"memory": "6Gi", r.GPU_RESOURCE: "1"},
    }
    assert box["securityContext"] == engine["securityContext"]
    assert dep["spec"]["replicas"] == 1


def test_the_encoder_pod_template_override_is_its_own(sample: dict[str, Any]) -> None:
    """spec.encoder.podTemplate merges over the encoder pods (by container name, as
    spec.podTemplate over the inference pods) and cannot take their selector labels away;
    spec.podTemplate does not reach them."""
    mounted = {"name": "venv", "mountPath": "/venv", "readOnly": True}
    sample["spec"]["podTemplate"] = {"spec": {"hostname": "inference-only"}}
    sample["spec"]["encoder"] = {
        "podTemplate": {
            "metadata": {"labels": {r.LABEL_NAME: "other", "team": "vision"}},
            "spec": {
                "containers": [{"name": "encoder", "volumeMounts": [mounted]}],
                "volumes": [{"name": "venv", "persistentVolumeClaim": {"claimName": "venv"}}],
            },
        }
    }
    spec = parse_spec(sample["spec"])
    assert spec.encoder is not None
    template = encoder.deployment(sample, spec, spec.encoder)["spec"]["template"]
    (box,) = template["spec"]["containers"]
    assert box["volumeMounts"][-1] == mounted and len(box["volumeMounts"]) == 3
    assert template["spec"]["volumes"][-1]["name"] == "venv"
    assert "hostname" not in template["spec"]
    assert template["metadata"]["labels"]["team"] == "vision"
    assert encoder.selector("llava").items() <= template["metadata"]["labels"].items()
    sample["spec"]["encoder"]["podTemplate"] = ["not", "an", "object"]
    with pytest.raises(InvalidSpecError, match=r"spec\.encoder\.podTemplate"):
        parse_spec(sample["spec"])


AUTO = "spec.encoder.autoscaling"


@pytest.mark.parametrize(
    ("encoder_spec", "field", "words"),
    [
        ({"replicas": 0}, "spec.encoder.replicas", "[1, 1000]"),
        ({"replicas": True}, "spec.encoder.replicas", "[1, 1000]"),
        ({"resources": {"gpus": -1}}, "spec.encoder.resources.gpus", "[0, 64]"),
        ({"resources": {"cpu": "0"}}, "spec.encoder.resources.cpu", "positive"),
        ({"resources": {"memory": "lots"}}, "spec.encoder.resources.memory", "quantity"),
        ({"autoscaling": {"enabled": True, "target": 2}}, f"{AUTO}.maxReplicas", "required"),
        ({"autoscaling": {"enabled": True, "maxReplicas": 2}}, f"{AUTO}.target", ENCODER_QUEUE),
        (
            {"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 2, "target": 1}},
            "spec.encoder.autoscaling",
            "must not exceed",
        ),
        ("yes", "spec.encoder", "object"),
    ],
)  # fmt: skip
def test_invalid_encoder_specs_name_the_field(
    sample: dict[str, Any], encoder_spec: Any, field: str, words: str
) -> None:
    sample["spec"]["encoder"] = encoder_spec
    with pytest.raises(InvalidSpecError) as info:
        parse_spec(sample["spec"])
    assert info.value.field == field and words in str(info.value)


def test_encoder_defaults(sample: dict[str, Any]) -> None:
    sample["spec"]["encoder"] = {}
    enc = parse_spec(sample["spec"]).encoder
    assert enc is not None
    assert (enc.replicas, enc.gpus, enc.cpu, enc.memory_bytes) == (1, 1, "2", 8 * GI)
    assert enc.autoscaling is None
    sample["spec"]["resources"]["gpus"] = 0  # a CPU pool gets CPU encoders
    assert parse_spec(sample["spec"]).encoder.gpus == 0  # type: ignore[union-attr]


def test_encoder_autoscaler_scales_the_encoder_deployment_on_its_queue(
    sample: dict[str, Any],
) -> None:
    auto = {"enabled": True, "maxReplicas": 6, "target": 8, "scaleDownStabilizationSeconds": 60}
    sample["spec"]["encoder"] = {"replicas": 2, "autoscaling": auto}
    spec = parse_spec(sample["spec"])
    enc = spec.encoder
    assert enc is not None and enc.autoscaling is not None
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llava-encoder"}
    hpa = encoder.autoscaler(sample, enc, "HorizontalPodAutoscaler")
    assert hpa is not None and hpa["spec"]["scaleTargetRef"] == target
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 6)
    assert hpa["spec"]["metrics"][0]["pods"]["metric"] == {"name": ENCODER_QUEUE}
    assert hpa["spec"]["behavior"]["scaleDown"] == {"stabilizationWindowSeconds": 60}
    keda = encoder.autoscaler(sample, enc, "ScaledObject")
    assert keda is not None and keda["spec"]["scaleTargetRef"] == target
    query = keda["spec"]["triggers"][0]["metadata"]["query"]
    pods = re.search(r'pod=~"([^"]+)"', query)
    assert pods is not None and query.startswith(f"sum({ENCODER_QUEUE}{{")
    assert re.fullmatch(pods[1], "llava-encoder-5d8f9c-x2k4q")
    assert not re.fullmatch(pods[1], "llava-5d8f9c-x2k4q")  # the PD pods
    assert not re.fullmatch(pods[1], "llava-encoder-big-5d8f9c-x2k4q")  # llava-encoder-big's
    # the autoscaler owns the count: the Deployment's manifest leaves replicas out
    assert "replicas" not in encoder.deployment(sample, spec, enc)["spec"]
    # and the resource's own autoscaler (the PD pods) is untouched by it
    assert builders.autoscaler(sample, spec, "HorizontalPodAutoscaler") is None


def test_crd_schema_of_the_encoder_matches_the_parser() -> None:
    (version,) = yaml.safe_load(CRD.read_text())["spec"]["versions"]
    props = version["schema"]["openAPIV3Schema"]["properties"]
    section = props["spec"]["properties"]["encoder"]
    assert set(section["properties"]) == {"replicas", "resources", "autoscaling", "podTemplate"}
    assert set(section["properties"]["resources"]["properties"]) == {"gpus", "cpu", "memory"}
    auto = section["properties"]["autoscaling"]["properties"]
    assert set(auto) == {
        "enabled", "minReplicas", "maxReplicas", "target",
        "scaleUpStabilizationSeconds", "scaleDownStabilizationSeconds", "prometheusAddress",
    }  # fmt: skip
    assert '"default":' not in json.dumps(section)  # unset is what the operator derives
    assert (section["properties"]["replicas"]["minimum"], auto["maxReplicas"]["maximum"]) == (
        1,
        1000,
    )
    assert props["status"]["properties"][status.ENCODER_FALLBACKS] == {
        "type": "number",
        "description": props["status"]["properties"][status.ENCODER_FALLBACKS]["description"],
    }


# --- The reconciler ---------------------------------------------------------------------------

ENCODER_PATHS = {
    "Deployment": object_path("apps/v1", "Deployment", "ml", "llava-encoder"),
    "Service": object_path("v1", "Service", "ml", "llava-encoder"),
    "NetworkPolicy": object_path("networking.k8s.io/v1", "NetworkPolicy", "ml", "llava-encoder"),
    "HorizontalPodAutoscaler": object_path(
        "autoscaling/v2", "HorizontalPodAutoscaler", "ml", "llava-encoder"
    ),
}
SECRET = object_path("v1", "Secret", "ml", "llava-internal")


class FakeDiscovery:
    def keda(self) -> bool:
        return False

    def pod_monitors(self) -> bool:
        return False

    def inference_pools(self) -> bool:
        return False


def _reconciler(kube: Any, encoders: bool = True) -> Reconciler:
    return Reconciler(
        kube,
        integrations=Integrations(autoscaler="hpa", pod_monitors="off"),
        discovery=FakeDiscovery(),  # type: ignore[arg-type]
        security=Security(encoders=encoders),
    )


def _condition(kube: Any) -> dict[str, Any] | None:
    found = [c for c in kube.obj["status"]["conditions"] if c["type"] == r.ENCODERS]
    return found[0] if found else None


def test_reconcile_applies_the_encoders_then_deletes_them_when_the_spec_drops_them(
    sample: dict[str, Any], kube_factory: Any
) -> None:
    sample["spec"]["encoder"] = {"autoscaling": {"enabled": True, "maxReplicas": 3, "target": 4}}
    kube = kube_factory(sample)
    reconciler = _reconciler(kube)
    reconciler.reconcile(sample)
    assert set(ENCODER_PATHS.values()) <= set(kube.children)
    assert kube.created == [SECRET]  # the token, before the pods that read it
    front = _front(kube.children[object_path("apps/v1", "Deployment", "ml", "llava")])
    assert "--encoder-service" in front["args"]
    condition = _condition(kube)
    assert condition is not None and (condition["status"], condition["reason"]) == (
        "True",
        "EncodersApplied",
    )
    kube.obj["status"][status.ENCODER_FALLBACKS] = 1.5  # the probe's, while encoders ran
    # a steady reconcile deletes nothing
    reconciler.reconcile(sample)
    assert kube.deleted == []
    # the autoscaler goes alone when autoscaling is turned off; the count comes back
    sample["spec"]["encoder"] = {"replicas": 2}
    reconciler.reconcile(sample)
    assert kube.deleted == [ENCODER_PATHS["HorizontalPodAutoscaler"]]
    assert kube.children[ENCODER_PATHS["Deployment"]]["spec"]["replicas"] == 2
    del sample["spec"]["encoder"]
    reconciler.reconcile(sample)
    assert not set(ENCODER_PATHS.values()) & set(kube.children)
    assert _condition(kube) is None and status.ENCODER_FALLBACKS not in kube.obj["status"]
    pd = kube.children[object_path("apps/v1", "Deployment", "ml", "llava")]
    assert "--encoder-service" not in _front(pd)["args"]
    # afterwards a reconcile without encoders asks for nothing of them
    gets, deleted = len(kube.gets), list(kube.deleted)
    reconciler.reconcile(sample)
    assert kube.deleted == deleted
    assert not [p for p in kube.gets[gets:] if "llava-encoder" in p]


def test_an_operator_installed_without_encoders_refuses_them_and_builds_plain_pods(
    sample: dict[str, Any], kube_factory: Any
) -> None:
    plain = copy.deepcopy(sample)
    sample["spec"]["encoder"] = {}
    kube = kube_factory(sample)
    _reconciler(kube, encoders=False).reconcile(sample)
    assert not [p for p in kube.children if "llava-encoder" in p]
    assert kube.created == []  # no right on Secrets: no token
    dep = kube.children[object_path("apps/v1", "Deployment", "ml", "llava")]
    del dep["metadata"]["generation"]  # the fake API server's
    assert _bytes(dep) == _bytes(builders.deployment(plain, parse_spec(plain["spec"])))
    condition = _condition(kube)
    assert condition is not None and (condition["status"], condition["reason"]) == (
        "False",
        "EncodersNotEnabled",
    )
    assert "encoder.enabled=true" in condition["message"]
    assert kube.events[-1] == ("Warning", "EncodersNotEnabled")


def test_first_reconcile_in_a_process_deletes_encoders_an_earlier_one_left(
    sample: dict[str, Any], kube_factory: Any
) -> None:
    with_encoder = copy.deepcopy(sample)
    with_encoder["spec"]["encoder"] = {}
    kube = kube_factory(sample)
    _reconciler(kube).reconcile(with_encoder)
    assert ENCODER_PATHS["Deployment"] in kube.children
    _reconciler(kube).reconcile(sample)  # a new operator process, the field gone meanwhile
    assert ENCODER_PATHS["Deployment"] not in kube.children
    # what it looked for: the kinds it may have applied, none whose API the cluster lacks
    looked = {p for p in kube.gets if p.endswith("/llava-encoder")}
    assert looked == set(ENCODER_PATHS.values())


# --- The probe's encoder fallbacks per minute -------------------------------------------------

METRICS = """# HELP mmis_encoder_fallbacks_total Items sent with pixels.
# TYPE mmis_encoder_fallbacks_total counter
mmis_encoder_fallbacks_total{model="m",reason="timeout"} 3.0
mmis_encoder_fallbacks_total{model="m",reason="down"} 4
mmis_encoder_fallbacks_total_created{model="m",reason="down"} 1.7e9
mmis_encoder_requests_total{outcome="ok"} 99
"""


def test_fallbacks_total_sums_every_reason_and_nothing_else() -> None:
    assert status.fallbacks_total(METRICS) == 7.0
    assert status.fallbacks_total("mmis_encoder_requests_total 5\n") == 0.0
    with pytest.raises(status.StatsError):
        status.fallbacks_total('mmis_encoder_fallbacks_total{reason="down"} x\n')


def test_fallbacks_per_minute_over_pods_sampled_twice() -> None:
    before = {"a": (0.0, 10.0), "b": (0.0, 5.0), "gone": (0.0, 100.0)}
    now = {"a": (30.0, 13.0), "b": (30.0, 2.0), "new": (30.0, 50.0)}
    # a: +3; b restarted (its counter went down): 2 since; gone/new: not sampled twice
    assert status.fallbacks_per_minute(before, now) == 10.0
    assert status.fallbacks_per_minute({}, now) is None


class _Handler(http.server.BaseHTTPRequestHandler):
    answers: dict[str, bytes] = {}

    def do_GET(self) -> None:
        payload = self.answers.get(self.path)
        self.send_response(200 if payload is not None else 404)
        self.end_headers()
        self.wfile.write(payload or b"")

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


STATS = {
    "drift_rate": 0.0, "hit_rate": 0.5, "retry_rate": 0.0, "window_seconds": 60.0,
    "shadow_hits": 4, "drift_misses": 0, "queries": 8, "retries": 0, "requests": 8,
}  # fmt: skip


async def test_the_probe_writes_encoder_fallbacks_per_minute(
    sample: dict[str, Any], kube_factory: Any, server: str
) -> None:
    sample["spec"]["encoder"] = {}
    sample["metadata"]["annotations"] = {OVERRIDE_ANNOTATION: f"{server}/p0"}
    kube = kube_factory(sample)
    pod = {
        "metadata": {"name": "llava-1"},
        "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    probe = CoherenceProbe(kube, allow_override=True)
    probe.list_pods = lambda namespace, name: [pod]  # type: ignore[method-assign]
    clock = iter([100.0, 130.0])
    probe.clock = lambda: next(clock)
    _Handler.answers = {
        "/p0/stats/cache": json.dumps(STATS).encode(),
        "/p0/metrics": b'mmis_encoder_fallbacks_total{reason="down"} 2\n',
    }
    await probe.run(sample, 0.01)
    assert status.ENCODER_FALLBACKS not in kube.obj["status"]  # one sample: no rate yet
    _Handler.answers["/p0/metrics"] = b'mmis_encoder_fallbacks_total{reason="down"} 7\n'
    await probe.run(sample, 0.01)
    assert kube.obj["status"][status.ENCODER_FALLBACKS] == 10.0  # 5 in 30 s
    assert kube.obj["status"]["cache"]["shadowHits"] == 4  # the coherence part as before
    # without spec.encoder the probe asks for no /metrics at all
    del sample["spec"]["encoder"]
    _Handler.answers.pop("/p0/metrics")
    probe.clock = lambda: 1 / 0
    await probe.run(sample, 0.01)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--write-golden":
        sys.exit("usage: test_encoder.py --write-golden NOTE")
    write_golden(sys.argv[2])


# --- The chart: encoder.enabled -------------------------------------------------------------


def _container_args(docs: list[dict[str, Any]]) -> list[str]:
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    (box,) = dep["spec"]["template"]["spec"]["containers"]
    return list(box["args"])


def test_the_charts_encoder_value_grants_only_secret_create_and_tells_the_operator() -> None:
    """encoder.enabled adds exactly one rule to each of the operator's roles (create Secrets,
    for the internal token), and ``--encoders``, which the operator parses into its Security;
    with routing too, the rule is there once. Every other least-privilege rule holds."""
    from tests.security.test_rbac import CHART, _docs, _rules, violations

    plain, enabled = _docs(CHART), _docs(CHART, "--set", "encoder.enabled=true")
    rules: dict[str, list[Any]] = {where: [] for where, _ in _rules(enabled)}
    for where, rule in _rules(enabled):
        rules[where].append(rule)
    for where, rule in _rules(plain):
        rules[where].remove(rule)
    secret = {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}
    assert rules == {where: [secret] for where in rules} and rules
    assert "--encoders" in _container_args(enabled)
    assert "--encoders" not in _container_args(plain)
    assert violations(enabled, routing_enabled=True) == []  # secrets: create only
    both = _docs(CHART, "--set", "encoder.enabled=true", "--set", "routing.enabled=true")
    assert [r for _, r in _rules(both) if "secrets" in r["resources"]] == [secret]
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    assert main.options_from_args(parser.parse_args(["--encoders"])).security().encoders
    assert not main.options_from_args(parser.parse_args([])).security().encoders


def test_the_charts_own_pod_monitor_scrapes_the_encoder_pods_too(sample: dict[str, Any]) -> None:
    """With podMonitor.enabled the operator makes no PodMonitor of its own (the chart's
    replace them): a second one of the chart's selects the encoder pods on their health port."""
    from tests.security.test_rbac import CHART, _docs

    docs = _docs(CHART, "--set", "podMonitor.enabled=true")
    (monitor,) = [
        d for d in docs if d["kind"] == "PodMonitor" and d["metadata"]["name"].endswith("-encoders")
    ]
    sample["spec"]["encoder"] = {}
    spec = parse_spec(sample["spec"])
    assert spec.encoder is not None
    template = encoder.deployment(sample, spec, spec.encoder)["spec"]["template"]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (box,) = template["spec"]["containers"]
    assert (endpoint["port"], endpoint["path"]) == (r.ENCODER_HEALTH_PORT_NAME, "/metrics")
    assert endpoint["port"] in {p["name"] for p in box["ports"]}
    # and the operator's own one for a resource is the same scrape
    own = encoder.pod_monitor(sample, spec)
    assert own["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert own["spec"]["podMetricsEndpoints"][0]["port"] == endpoint["port"]
