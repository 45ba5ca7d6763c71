"""The reconciler's side of ``spec.routing``: the operator's installation (a picker
ClusterRole to bind) and discovery decide whether the routing objects are applied, the
``Routing`` condition says why, the internal token's Secret is created once and never touched
again, and the objects are deleted when the spec drops them; the NetworkPolicies follow the
operator's setting (against an in-memory API, conftest.FakeKube; the real one in tests/kube)."""

from __future__ import annotations

import copy
from typing import Any

from mmis_operator import kube as r
from mmis_operator import routing, status
from mmis_operator.kube import KubeError, object_path
from mmis_operator.reconciler import Integrations, Reconciler, Security
from mmis_operator.status import Condition, Transition

ROUTING_KINDS = {kind for _, kind, _ in routing.object_refs("llava")}
ROLE = "rel-mmis-operator-picker"
PLAIN = {"Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"}  # without routing
SECRET = object_path("v1", "Secret", "ml", "llava-internal")


class FakeDiscovery:
    def __init__(self, pools: bool) -> None:
        self.pools = pools

    def keda(self) -> bool:
        return False

    def pod_monitors(self) -> bool:
        return False

    def inference_pools(self) -> bool:
        return self.pools


def _reconciler(kube: Any, pools: bool, **security: Any) -> Reconciler:
    settings = Integrations(autoscaler="hpa", pod_monitors="off")
    allowed = Security(**{"picker_cluster_role": ROLE, **security})
    return Reconciler(
        kube,
        integrations=settings,
        discovery=FakeDiscovery(pools),  # type: ignore[arg-type]
        security=allowed,
    )


def _engine(kube: Any) -> dict[str, Any]:
    dep = kube.children[object_path("apps/v1", "Deployment", "ml", "llava")]
    (engine,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == r.ENGINE]
    return dict(engine)


def _routing_condition(kube: Any) -> dict[str, Any] | None:
    found = [c for c in kube.obj["status"]["conditions"] if c["type"] == r.ROUTING]
    return found[0] if found else None


def _with_routing(sample: dict[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(sample)
    obj["spec"]["routing"] = {"cacheWeight": 5}
    return obj


def test_without_routing_nothing_is_applied_and_no_condition(
    sample: dict[str, Any], kube_factory: Any
) -> None:
    kube = kube_factory(sample)
    _reconciler(kube, pools=True).reconcile(sample)
    assert kube.kinds() == PLAIN
    assert _routing_condition(kube) is None
    assert kube.deleted == []  # nothing of routing existed
    assert kube.created == []  # no token without routing


def test_missing_inference_pool_api_creates_nothing_and_says_what_to_install(
    sample: dict[str, Any], kube_factory: Any
) -> None:
    obj = _with_routing(sample)
    kube = kube_factory(obj)
    _reconciler(kube, pools=False).reconcile(obj)
    assert not kube.kinds() & ROUTING_KINDS - {"Deployment", "Service", "NetworkPolicy"}
    # the resource's own children, and the token its engines already need
    assert sorted(c["metadata"]["name"] for c in kube.children.values()) == [
        *["llava"] * 4, "llava-internal",
    ]  # fmt: skip
    cond = _routing_condition(kube)
    assert cond is not None
    assert (cond["status"], cond["reason"]) == ("False", "InferencePoolAPIMissing")
    assert "Gateway API Inference Extension" in cond["message"]
    assert "v1.x" in cond["message"]
    assert ("Warning", "InferencePoolAPIMissing") in kube.events
    # the engines still publish their events: the picker comes once the CRDs are installed
    assert "--kv-events-endpoint" in _engine(kube)["args"]


def test_an_operator_installed_without_routing_refuses_it_and_builds_plain_pods(
    sample: dict[str, Any], kube_factory: Any
) -> None:
    """No picker ClusterRole to bind (the chart's routing.enabled=false): Routing False with
    RoutingNotEnabled, nothing of routing, no token, and pods that need neither (an engine
    publishing events without the token would refuse to start)."""
    obj = _with_routing(sample)
    kube = kube_factory(obj)
    _reconciler(kube, pools=True, picker_cluster_role="").reconcile(obj)
    assert kube.kinds() == PLAIN and kube.created == []
    cond = _routing_condition(kube)
    assert cond is not None
    assert (cond["status"], cond["reason"]) == ("False", "RoutingNotEnabled")
    assert "routing.enabled=true" in cond["message"]
    assert ("Warning", "RoutingNotEnabled") in kube.events
    plain = _reconciler(kube_factory(sample), pools=True)
    plain.reconcile(sample)
    dep = kube.children[object_path("apps/v1", "Deployment", "ml", "llava")]
    assert dep == plain.kube.children[object_path("apps/v1", "Deployment", "ml", "llava")]
    policy = kube.children[object_path("networking.k8s.io/v1", "NetworkPolicy", "ml", "llava")]
    assert len(policy["spec"]["ingress"]) == 2  # no event ports


def test_the_token_secret_is_created_once_and_never_touched_again(
    sample: dict[str, Any], kube_factory: Any
) -> None:
    obj = _with_routing(sample)
    kube = kube_factory(obj)
    rec = _reconciler(kube, pools=True)
    rec.reconcile(obj)
    first = kube.children[SECRET]
    token = first["stringData"]["token"]
    assert len(token) == 64 and int(token, 16) >= 0  # 32 random bytes, hex
    assert first["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    # created before the Deployment whose pods read it
    assert list(kube.children).index(SECRET) < list(kube.children).index(
        object_path("apps/v1", "Deployment", "ml", "llava")
    )
    rec.reconcile(obj)
    _reconciler(kube, pools=True).reconcile(obj)  # a new process draws a new token...
    assert kube.children[SECRET]["stringData"]["token"] == token  # ...and the 409 keeps the old
    assert kube.created == [SECRET] * 3
    # never read, listed, changed nor deleted: garbage collection removes it with the resource
    assert SECRET not in kube.gets and SECRET not in kube.deleted
    obj["spec"].pop("routing")
    kube.obj["spec"] = obj["spec"]
    rec.reconcile(obj)
    assert SECRET not in kube.deleted and SECRET not in kube.gets


def test_a_role_binding_with_another_role_ref_is_replaced(
    sample: dict[str, Any], kube_factory: Any
) -> None:
    """roleRef is immutable: the binding an earlier operator made to its own Role is deleted
    and made again to the chart's ClusterRole (the API server answers such an apply 422)."""
    obj = _with_routing(sample)
    kube = kube_factory(obj)
    binding = object_path("rbac.authorization.k8s.io/v1", "RoleBinding", "ml", "llava-epp")
    owner = [{"uid": "uid-1"}]
    kube.children[binding] = {
        "kind": "RoleBinding",
        "metadata": {"name": "llava-epp", "ownerReferences": owner},
        "roleRef": {"kind": "Role", "name": "llava-epp"},
    }
    plain_apply = kube.apply

    def apply(manifest: dict[str, Any]) -> dict[str, Any]:
        meta = manifest["metadata"]
        path = object_path(manifest["apiVersion"], manifest["kind"], "ml", meta["name"])
        old = kube.children.get(path)
        if old is not None and old.get("roleRef", manifest.get("roleRef")) != manifest.get(
            "roleRef"
        ):
            raise KubeError(422, "cannot change roleRef", "Invalid")
        return plain_apply(manifest)

    kube.apply = apply
    _reconciler(kube, pools=True).reconcile(obj)
    assert binding in kube.deleted
    assert kube.children[binding]["roleRef"]["kind"] == "ClusterRole"
    assert _routing_condition(kube)["reason"] == "InferencePoolApplied"  # type: ignore[index]


def test_served_api_applies_every_routing_object_then_removal_deletes_them(
    sample: dict[str, Any], kube_factory: Any
) -> None:
    obj = _with_routing(sample)
    kube = kube_factory(obj)
    rec = _reconciler(kube, pools=True)
    rec.reconcile(obj)
    assert kube.kinds() >= ROUTING_KINDS | {"Secret"}
    picker = kube.children[object_path("apps/v1", "Deployment", "ml", "llava-epp")]
    assert picker["spec"]["template"]["spec"]["containers"][0]["name"] == "epp"
    cond = _routing_condition(kube)
    assert cond is not None and (cond["status"], cond["reason"]) == (
        "True", "InferencePoolApplied",
    )  # fmt: skip
    assert ("Normal", "InferencePoolApplied") in kube.events
    # the resource's own Deployment is what status reads, not the picker's
    assert kube.obj["status"]["selector"] == r.selector_string("llava")

    obj["spec"].pop("routing")
    kube.obj["spec"] = obj["spec"]
    rec.reconcile(obj)
    assert kube.kinds() == PLAIN | {"Secret"}  # the Secret goes with the resource
    assert len(kube.deleted) == len(ROUTING_KINDS)
    assert _routing_condition(kube) is None  # the condition goes with the field
    # a steady reconcile without routing looks for none of them again
    kube.gets.clear()
    rec.reconcile(obj)
    assert not any("-epp" in path or "inferencepools" in path for path in kube.gets)


def test_first_reconcile_in_a_process_deletes_what_an_earlier_one_left(
    sample: dict[str, Any], kube_factory: Any
) -> None:
    obj = _with_routing(sample)
    kube = kube_factory(obj)
    _reconciler(kube, pools=True).reconcile(obj)
    obj["spec"].pop("routing")
    kube.obj["spec"] = obj["spec"]
    _reconciler(kube, pools=True).reconcile(obj)  # a new operator process: no in-memory hint
    assert not kube.kinds() & {"InferencePool", "RoleBinding", "ServiceAccount"}


def test_routing_objects_of_another_owner_are_left_alone(
    sample: dict[str, Any], kube_factory: Any
) -> None:
    kube = kube_factory(sample)
    foreign = {
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": "llava-epp", "namespace": "ml", "ownerReferences": [{"uid": "x"}]},
    }  # fmt: skip
    kube.apply(foreign)
    _reconciler(kube, pools=True).reconcile(sample)
    assert "ServiceAccount" in kube.kinds()


def test_dropped_conditions_and_routing_events() -> None:
    current = {"conditions": [{"type": "Ready", "status": "True"}, {"type": r.ROUTING}]}
    desired = status.DesiredStatus({}, (), dropped=(r.ROUTING,))
    merged = status.merged_status(current, desired, 1)
    assert [c["type"] for c in merged["conditions"]] == ["Ready"]
    assert "conditions" not in status.merged_status({}, desired, 1)  # nothing to drop: no write
    missing = Condition(r.ROUTING, "False", "InferencePoolAPIMissing", "install")
    assert status.event_type(Transition(r.ROUTING, None, missing)) == "Warning"
    applied = Condition(r.ROUTING, "True", "InferencePoolApplied", "ok")
    assert status.event_type(Transition(r.ROUTING, "False", applied)) == "Normal"


def test_rbac_from_before_routing_is_no_failure_without_routing(
    sample: dict[str, Any], kube_factory: Any
) -> None:
    """An operator installed without routing (the chart's default) cannot read the picker's
    kinds; without spec.routing that is no failure (what it cannot read, it never created)."""
    kube = kube_factory(sample)
    plain_get = kube.get

    def get(path: str) -> dict[str, Any] | None:
        if any(kind in path for kind in ("/serviceaccounts/", "/rolebindings/", "/inferencep")):
            raise KubeError(403, "forbidden", "Forbidden")
        return plain_get(path)

    kube.get = get
    _reconciler(kube, pools=True, picker_cluster_role="").reconcile(sample)
    assert kube.kinds() == PLAIN


def test_network_policies_follow_the_setting(sample: dict[str, Any], kube_factory: Any) -> None:
    obj = _with_routing(sample)
    kube = kube_factory(obj)
    peer = {"operator_namespace": "mmis-system", "operator_labels": {"app": "op"}}
    _reconciler(kube, pools=True, **peer).reconcile(obj)
    policies = {
        c["metadata"]["name"]: c for c in kube.children.values() if c["kind"] == "NetworkPolicy"
    }
    assert set(policies) == {"llava", "llava-epp"}
    ops = policies["llava"]["spec"]["ingress"][1]
    assert {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mmis-system"}},
        "podSelector": {"matchLabels": {"app": "op"}},
    } in ops["from"]
    # the setting turned off (a new process, the chart's networkPolicy.enabled=false): both go
    off = _reconciler(kube, pools=True, network_policies=False)
    off.reconcile(obj)
    assert "NetworkPolicy" not in kube.kinds()
    assert {p for p in kube.deleted if "networkpolicies" in p} == {
        object_path("networking.k8s.io/v1", "NetworkPolicy", "ml", name)
        for name in ("llava", "llava-epp")
    }
    # and a steady reconcile looks for none of them again
    kube.gets.clear()
    off.reconcile(obj)
    assert not any("networkpolicies" in path for path in kube.gets)
