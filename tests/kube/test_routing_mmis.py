"""``spec.routing`` against the real control plane (issue 33): the operator's InferencePool and
endpoint picker.

- An operator installed without routing (no picker ClusterRole to bind) says so (Routing
  False, RoutingNotEnabled) and creates nothing of routing, not even the token.
- Without the InferencePool API the resource says what to install (Routing False) and nothing
  of routing is created but the internal token the engines already read.
- With the Gateway API Inference Extension's own InferencePool CRD (v1.5.0, from the Go module
  cache, ``kubecluster.inference_pool_crd``): without ``spec.routing`` nothing of routing
  exists and the Deployment is byte for byte the golden one (tests/operator/golden); adding it
  creates the pool (failing open), the picker (admitted under Pod Security ``restricted``), its
  Service, ServiceAccount, RoleBinding to the picker's ClusterRole and NetworkPolicy, the
  token's Secret and the engine's event flags; removing it deletes them all but the Secret
  (garbage collection takes it with the resource) and the Deployment is as before again.
- With the chart's RBAC (routing.enabled) and nothing more, the operator binds the chart's
  picker ClusterRole (it may ``bind`` it, never hold its rights) and creates the token.

The CRD is removed afterwards when this module installed it, so other tests see a bare cluster
(and one that another module left installed is removed for the first test and put back).
"""

from __future__ import annotations

import base64
import copy
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import operator_kit as ok
import pytest
from kubecluster import Cluster, ToolsMissing, apply_crds, inference_pool_crd
from tools import in_ci

from mmis_operator import builders, routing
from mmis_operator import kube as r
from mmis_operator.main import OperatorThread
from mmis_operator.spec import parse_spec

pytestmark = pytest.mark.controlplane

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "mmis"
GOLDEN = ROOT / "tests" / "operator" / "golden" / "children_without_routing.json"
BEFORE: dict[str, Any] = json.loads(GOLDEN.read_text())["cases"]["kube"]
NAME = BEFORE["resource"]["metadata"]["name"]  # "routed"
PICKER = routing.picker_name(NAME)
POOL_CRD = "inferencepools.inference.networking.k8s.io"
SECRET = routing.token_secret_name(NAME)
# kubectl's names of the routing objects' types
TYPES = {
    "ServiceAccount": "serviceaccounts",
    "RoleBinding": "rolebindings.rbac.authorization.k8s.io",
    "NetworkPolicy": "networkpolicies.networking.k8s.io",
    "Deployment": "deployments.apps",
    "Service": "services",
    "InferencePool": POOL_CRD,
}


@pytest.fixture(scope="module")
def picker_role(cluster: Cluster) -> Iterator[str]:
    """The picker's ClusterRole as the chart ships it (its rules: routing.PICKER_RULES,
    tests/security/test_rbac.py), for an operator run with --picker-cluster-role."""
    name = "mmis-test-picker"
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": list(routing.PICKER_RULES),
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(role))
    yield name
    cluster.kubectl("delete", "clusterrole", name, "--ignore-not-found", check=False)


def _resource(routing_spec: dict[str, Any] | None = None) -> dict[str, Any]:
    obj = {
        "apiVersion": r.API_VERSION,
        "kind": r.KIND,
        "metadata": {"name": NAME},
        "spec": copy.deepcopy(BEFORE["resource"]["spec"]),
    }
    if routing_spec is not None:
        obj["spec"]["routing"] = routing_spec
    return obj


def _pool_api_served(cluster: Cluster) -> bool:
    proc = cluster.kubectl("get", "crd", POOL_CRD, "--ignore-not-found", "-o", "name")
    return bool(proc.stdout.strip())


def _existing(cluster: Cluster, namespace: str, pool_api: bool = True) -> list[str]:
    """The routing objects of resource NAME that exist (kubectl's ``TYPE/NAME``)."""
    found = []
    for _, kind, name in routing.object_refs(NAME):
        if kind == routing.POOL_KIND and not pool_api:
            continue
        proc = cluster.kubectl(
            "get", "-n", namespace, f"{TYPES[kind]}/{name}", "--ignore-not-found", "-o", "name"
        )
        found += proc.stdout.split()
    return found


def _containers(dep: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in dep["spec"]["template"]["spec"]["containers"]}


def _contains(live: Any, built: Any, where: str = "") -> None:
    """Everything the operator built is in what the API server stored (which adds defaults)."""
    if isinstance(built, dict):
        assert isinstance(live, dict), where
        for key, value in built.items():
            assert key in live, f"{where}.{key} missing"
            _contains(live[key], value, f"{where}.{key}")
    elif isinstance(built, list):
        assert isinstance(live, list) and len(live) == len(built), where
        for i, (a, b) in enumerate(zip(live, built, strict=True)):
            _contains(a, b, f"{where}[{i}]")
    else:
        assert live == built, f"{where}: {live!r} != {built!r}"


def _bytes(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode()


def _assert_deployment_as_before_routing(cluster: Cluster, namespace: str) -> None:
    owner = ok.get(cluster, namespace, f"mmis/{NAME}")
    live = ok.get(cluster, namespace, f"deployment/{NAME}")
    # the builders, fed the spec as stored (CRD defaults filled in), give the bytes of before
    built = builders.deployment(owner, parse_spec(owner["spec"]))
    assert _bytes(built["spec"]) == _bytes(BEFORE["deployment"]["spec"])
    # and that is what the operator applied: applying the manifest of before, as the
    # operator's field manager, changes nothing (no new generation, the same template)
    before = copy.deepcopy(BEFORE["deployment"])
    before["metadata"]["namespace"] = namespace
    before["metadata"]["ownerReferences"][0]["uid"] = owner["metadata"]["uid"]
    dry = cluster.kubectl(
        "apply", "--server-side", "--dry-run=server", f"--field-manager={r.FIELD_MANAGER}",
        "--force-conflicts", "-n", namespace, "-o", "json", "-f", "-", input=json.dumps(before),
    )  # fmt: skip
    again = json.loads(dry.stdout)
    assert again["metadata"]["generation"] == live["metadata"]["generation"]
    assert _bytes(again["spec"]["template"]) == _bytes(live["spec"]["template"])


def _reconciled(cluster: Cluster, namespace: str) -> None:
    """Wait until the operator has applied the resource's current generation."""
    generation = ok.get(cluster, namespace, f"mmis/{NAME}")["metadata"]["generation"]
    jsonpath = f"--for=jsonpath={{.status.observedGeneration}}={generation}"
    ok.wait(cluster, namespace, f"mmis/{NAME}", jsonpath)


def _admitted(cluster: Cluster, namespace: str, template: dict[str, Any]) -> None:
    """A pod of ``template`` passes the namespace's admission (Pod Security) as it is."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "admission-check", **template["metadata"]},
        "spec": template["spec"],
    }
    proc = cluster.kubectl(
        "create", "--dry-run=server", "-n", namespace, "-f", "-", input=json.dumps(pod),
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr  # PSA warns where it would not enforce


def _pool_crd_file() -> Path:
    try:
        return inference_pool_crd()
    except ToolsMissing as exc:
        if in_ci():
            pytest.fail(f"InferencePool CRD unavailable with CI=true: {exc}", pytrace=False)
        pytest.skip(f"InferencePool CRD unavailable: {exc}")


@pytest.fixture(scope="module")
def pool_crd(cluster: Cluster) -> Iterator[None]:
    """The inference extension's InferencePool CRD, applied and Established."""
    path = _pool_crd_file()
    served_before = _pool_api_served(cluster)
    apply_crds(cluster, path, POOL_CRD)
    yield
    if not served_before:
        cluster.kubectl("delete", "crd", POOL_CRD, "--timeout=120s", check=False, timeout=150)


@pytest.fixture
def no_pool_api(cluster: Cluster) -> Iterator[None]:
    """The InferencePool API not served; one another test installed comes back afterwards."""
    if not _pool_api_served(cluster):
        yield
        return
    path = _pool_crd_file()
    cluster.kubectl("delete", "crd", POOL_CRD, "--timeout=120s", timeout=150)
    try:
        yield
    finally:
        apply_crds(cluster, path, POOL_CRD)


def _secret_exists(cluster: Cluster, namespace: str) -> bool:
    proc = cluster.kubectl("get", "-n", namespace, f"secret/{SECRET}", "--ignore-not-found")
    return bool(proc.stdout.strip())


def test_an_operator_without_routing_refuses_it(
    cluster: Cluster, crd: None, namespace: str
) -> None:
    with OperatorThread(cluster.kubeconfig, ok.options(namespace)) as running:
        ok.apply(cluster, namespace, _resource({}))
        ok.wait(cluster, namespace, f"mmis/{NAME}", "--for=condition=Routing=False")
        cond = ok.find_condition(ok.get(cluster, namespace, f"mmis/{NAME}"), r.ROUTING)
        assert cond is not None and cond["reason"] == "RoutingNotEnabled"
        assert "routing.enabled=true" in cond["message"]
        assert _existing(cluster, namespace, pool_api=_pool_api_served(cluster)) == []
        assert not _secret_exists(cluster, namespace)
        # pods an operator without routing can run: no event sockets, no token to read
        dep = ok.get(cluster, namespace, f"deployment/{NAME}")
        for container in _containers(dep).values():
            assert "--kv-events-endpoint" not in container["args"]
            assert SECRET not in json.dumps(container.get("env", []))
    assert running.error is None, f"the operator died: {running.error!r}"


def test_without_the_inference_pool_api_nothing_is_created(
    cluster: Cluster, crd: None, no_pool_api: None, namespace: str, picker_role: str
) -> None:
    options = ok.options(namespace, picker_cluster_role=picker_role)
    with OperatorThread(cluster.kubeconfig, options) as running:
        ok.apply(cluster, namespace, _resource({}))
        ok.wait(cluster, namespace, f"mmis/{NAME}", "--for=condition=Routing=False")
        owner = ok.get(cluster, namespace, f"mmis/{NAME}")
        cond = ok.find_condition(owner, r.ROUTING)
        assert cond is not None and cond["reason"] == "InferencePoolAPIMissing"
        assert "Gateway API Inference Extension" in cond["message"]
        assert "CRDs v1.x" in cond["message"]
        assert _existing(cluster, namespace, pool_api=False) == []
        # the engines publish their events already (with the token): the picker comes with
        # the CRDs
        engine = _containers(ok.get(cluster, namespace, f"deployment/{NAME}"))[r.ENGINE]
        assert "--kv-events-endpoint" in engine["args"]
        assert _secret_exists(cluster, namespace)
    assert running.error is None, f"the operator died: {running.error!r}"


def test_routing_adds_the_pool_and_the_picker_and_removing_it_deletes_them(
    cluster: Cluster, crd: None, pool_crd: None, namespace: str, picker_role: str
) -> None:
    options = ok.options(namespace, picker_cluster_role=picker_role)
    with OperatorThread(cluster.kubeconfig, options) as running:
        # without spec.routing: nothing of routing, and the Deployment of before
        ok.apply(cluster, namespace, _resource())
        _reconciled(cluster, namespace)
        assert _existing(cluster, namespace) == []
        assert not _secret_exists(cluster, namespace)
        assert ok.find_condition(ok.get(cluster, namespace, f"mmis/{NAME}"), r.ROUTING) is None
        _assert_deployment_as_before_routing(cluster, namespace)

        # with it
        ok.apply(cluster, namespace, _resource({"cacheWeight": 4}))
        ok.wait(cluster, namespace, f"mmis/{NAME}", "--for=condition=Routing")
        owner = ok.get(cluster, namespace, f"mmis/{NAME}")
        applied = ok.find_condition(owner, r.ROUTING)
        assert applied is not None and applied["reason"] == "InferencePoolApplied"
        scrapers = r.DEFAULT_SCRAPERS
        built = builders.routing_objects(owner, parse_spec(owner["spec"]), picker_role, scrapers)
        for manifest in built:
            kind, name = manifest["kind"], manifest["metadata"]["name"]
            live = ok.get(cluster, namespace, f"{TYPES[kind]}/{name}")
            body = {k: v for k, v in manifest.items() if k != "metadata"}
            _contains(live, body, f"{kind}/{name}")
            (ref,) = live["metadata"]["ownerReferences"]
            assert (ref["kind"], ref["uid"], ref["controller"]) == (
                r.KIND, owner["metadata"]["uid"], True,
            )  # fmt: skip
        pool = ok.get(cluster, namespace, f"{POOL_CRD}/{NAME}")["spec"]
        assert pool["selector"]["matchLabels"] == r.selector_labels(NAME)
        assert pool["targetPorts"] == [{"number": 8000}]
        assert pool["endpointPickerRef"]["name"] == PICKER
        assert pool["endpointPickerRef"]["port"] == {"number": 9002}
        assert pool["endpointPickerRef"]["failureMode"] == "FailOpen"
        # the internal token: created by the operator, owned by the resource, 32 random bytes
        secret = ok.get(cluster, namespace, f"secret/{SECRET}")
        token = base64.b64decode(secret["data"]["token"]).decode()
        assert len(token) == 64 and int(token, 16) >= 0
        (ref,) = secret["metadata"]["ownerReferences"]
        assert (ref["uid"], ref["controller"]) == (owner["metadata"]["uid"], True)
        # the picker's pods pass Pod Security "restricted" (the namespace enforces it)
        picker = ok.get(cluster, namespace, f"deployment/{PICKER}")
        _admitted(cluster, namespace, picker["spec"]["template"])
        (epp,) = picker["spec"]["template"]["spec"]["containers"]
        assert epp["args"][:4] == ["--pool-name", NAME, "--pool-namespace", namespace]
        weighted = routing.picker_config(ops_port=r.OPS_PORT, cache_weight=4)
        assert epp["args"][epp["args"].index("--config-text") + 1] == routing.render(weighted)
        assert epp["readinessProbe"]["grpc"] == {"port": 9003, "service": "inference-extension"}
        # its ServiceAccount reads what it watches here (the Role's rules, checked above, add
        # InferenceObjectives, whose API this cluster does not serve), and nothing else
        sa = f"system:serviceaccount:{namespace}:{PICKER}"
        for verb, what in (("watch", "pods"), ("list", POOL_CRD)):
            proc = cluster.kubectl(
                "auth", "can-i", verb, what, "-n", namespace, f"--as={sa}", check=False
            )
            assert proc.stdout.strip() == "yes", (verb, what, proc.stderr)
        for args in (("get", "secrets", "-n", namespace), ("list", "pods", "-n", "default")):
            proc = cluster.kubectl("auth", "can-i", *args, f"--as={sa}", check=False)
            assert proc.stdout.strip() == "no", args
        # the inference pods' policy (the API server accepted it), with the event ports' rule
        policy = ok.get(cluster, namespace, f"{TYPES['NetworkPolicy']}/{NAME}")
        assert policy["spec"]["podSelector"]["matchLabels"] == r.selector_labels(NAME)
        assert len(policy["spec"]["ingress"]) == 3
        # the engine publishes its cache events on named ports
        engine = _containers(ok.get(cluster, namespace, f"deployment/{NAME}"))[r.ENGINE]
        flags = routing.engine_event_args(routing.EventPorts())
        assert engine["args"][-len(flags) :] == flags
        assert {p["name"] for p in engine["ports"]} >= {
            "kv-events", "kv-replay", "mm-events", "mm-replay",
        }  # fmt: skip

        # without it again: all of it deleted, the condition gone, the Deployment of before
        ok.apply(cluster, namespace, _resource())
        _reconciled(cluster, namespace)
        ok.wait(cluster, namespace, f"deployment/{PICKER}", "--for=delete")
        assert _existing(cluster, namespace) == []
        assert ok.find_condition(ok.get(cluster, namespace, f"mmis/{NAME}"), r.ROUTING) is None
        _assert_deployment_as_before_routing(cluster, namespace)
        # the Secret stays (the operator never deletes one) until the resource goes
        assert _secret_exists(cluster, namespace)
    assert running.error is None, f"the operator died: {running.error!r}"


def _helm(cluster: Cluster, *args: str) -> None:
    proc = subprocess.run(
        [str(cluster.bin("helm")), *args], capture_output=True, text=True, env=cluster.env,
        timeout=300, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")


def test_the_chart_rbac_lets_the_operator_bind_the_pickers_role(
    cluster: Cluster, crd: None, pool_crd: None, namespace: str
) -> None:
    apply_crds(
        cluster, CHART / "crds", "mminferenceservices.mmis.dev", "clusterkopfpeerings.kopf.dev"
    )
    # the cluster-wide install (a namespaced one has the same rules in a Role, and makes kopf
    # wait about a minute for a namespace list it may not read)
    release = f"c{namespace[2:]}"
    _helm(cluster, "install", release, str(CHART), "--namespace", namespace,
          "--set", "routing.enabled=true")  # fmt: skip
    role = f"{release}-mmis-operator-picker"
    try:
        kubeconfig = cluster.kubeconfig_for_serviceaccount(namespace, f"{release}-mmis-operator")
        options = ok.options(namespace, picker_cluster_role=role)
        with OperatorThread(kubeconfig, options) as running:
            # two pickers elect a leader: the ClusterRole holds the lease rules too
            ok.apply(cluster, namespace, _resource({"picker": {"replicas": 2}}))
            ok.wait(cluster, namespace, f"mmis/{NAME}", "--for=condition=Routing")
            cond = ok.find_condition(ok.get(cluster, namespace, f"mmis/{NAME}"), r.ROUTING)
            assert cond is not None and cond["reason"] == "InferencePoolApplied", cond
            binding = ok.get(cluster, namespace, f"{TYPES['RoleBinding']}/{PICKER}")
            assert binding["roleRef"] == {
                "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role,
            }  # fmt: skip
            assert _secret_exists(cluster, namespace)
            sa = f"system:serviceaccount:{namespace}:{PICKER}"
            for verb, what in (("watch", "pods"), ("create", "leases.coordination.k8s.io")):
                proc = cluster.kubectl(
                    "auth", "can-i", verb, what, "-n", namespace, f"--as={sa}", check=False
                )
                assert proc.stdout.strip() == "yes", (verb, what, proc.stderr)
        assert running.error is None, f"the operator died: {running.error!r}"
        # the operator holds none of the picker's rights, and may bind no other role
        for args in (
            ("create", "leases.coordination.k8s.io", "-n", namespace),
            ("get", "secrets", "-n", namespace),
            ("bind", "clusterroles/cluster-admin"),
            ("create", "roles.rbac.authorization.k8s.io", "-n", namespace),
        ):
            proc = cluster.kubectl("auth", "can-i", *args, kubeconfig=kubeconfig, check=False)
            assert proc.stdout.strip() == "no", args
        proc = cluster.kubectl(
            "auth", "can-i", "bind", f"clusterroles/{role}", "-n", namespace,
            kubeconfig=kubeconfig, check=False,
        )  # fmt: skip
        assert proc.stdout.strip() == "yes", proc.stderr
    finally:
        subprocess.run(
            [str(cluster.bin("helm")), "uninstall", release, "--namespace", namespace],
            capture_output=True, env=cluster.env, timeout=300, check=False,
        )  # fmt: skip
