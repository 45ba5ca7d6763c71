"""The reconciler's side of ``spec.routing``: discovery decides whether the routing objects
are applied, the ``Routing`` condition says why, and they are deleted when the spec drops
them (against an in-memory API, conftest.FakeKube; the real one in tests/kube)."""

from __future__ import annotations

import copy
from typing import Any

from mmis_operator import kube as r
from mmis_operator import routing, status
from mmis_operator.kube import KubeError, object_path
from mmis_operator.reconciler import Integrations, Reconciler
from mmis_operator.status import Condition, Transition

ROUTING_KINDS = {kind for _, kind, _ in routing.object_refs("llava")}


class FakeDiscovery:
    def __init__(self, pools: bool) -> None:
        self.pools = pools

    def keda(self) -> bool:
        return False

    def pod_monitors(self) -> bool:
        return False

    def inference_pools(self) -> bool:
        return self.pools


def _reconciler(kube: Any, pools: bool) -> Reconciler:
    settings = Integrations(autoscaler="hpa", pod_monitors="off")
    return Reconciler(kube, integrations=settings, discovery=FakeDiscovery(pools))  # type: ignore[arg-type]


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
    assert kube.kinds() == {"Deployment", "Service", "PodDisruptionBudget"}
    assert _routing_condition(kube) is None
    assert kube.deleted == []  # nothing of routing existed


def test_missing_inference_pool_api_creates_nothing_and_says_what_to_install(
    sample: dict[str, Any], kube_factory: Any
) -> None:
    obj = _with_routing(sample)
    kube = kube_factory(obj)
    _reconciler(kube, pools=False).reconcile(obj)
    assert not kube.kinds() & ROUTING_KINDS - {"Deployment", "Service"}
    assert [c["metadata"]["name"] for c in kube.children.values()] == ["llava"] * 3
    cond = _routing_condition(kube)
    assert cond is not None
    assert (cond["status"], cond["reason"]) == ("False", "InferencePoolAPIMissing")
    assert "Gateway API Inference Extension" in cond["message"]
    assert "v1.x" in cond["message"]
    assert ("Warning", "InferencePoolAPIMissing") in kube.events
    # the engines still publish their events: the picker comes once the CRDs are installed
    dep = kube.children[object_path("apps/v1", "Deployment", "ml", "llava")]
    engine = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == r.ENGINE]
    assert "--kv-events-endpoint" in engine[0]["args"]


def test_served_api_applies_every_routing_object_then_removal_deletes_them(
    sample: dict[str, Any], kube_factory: Any
) -> None:
    obj = _with_routing(sample)
    kube = kube_factory(obj)
    rec = _reconciler(kube, pools=True)
    rec.reconcile(obj)
    assert kube.kinds() >= ROUTING_KINDS
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
    assert kube.kinds() == {"Deployment", "Service", "PodDisruptionBudget"}
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
    assert not kube.kinds() & {"InferencePool", "ConfigMap", "Role"}


def test_routing_objects_of_another_owner_are_left_alone(
    sample: dict[str, Any], kube_factory: Any
) -> None:
    kube = kube_factory(sample)
    foreign = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "llava-epp", "namespace": "ml", "ownerReferences": [{"uid": "x"}]},
    }  # fmt: skip
    kube.apply(foreign)
    _reconciler(kube, pools=True).reconcile(sample)
    assert "ConfigMap" in kube.kinds()


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
    """An operator whose RBAC predates spec.routing cannot read the picker's kinds; without
    spec.routing that is no failure (what it cannot read, it never created)."""
    kube = kube_factory(sample)
    plain_get = kube.get

    def get(path: str) -> dict[str, Any] | None:
        if any(kind in path for kind in ("/configmaps/", "/serviceaccounts/", "/roles/")):
            raise KubeError(403, "forbidden", "Forbidden")
        return plain_get(path)

    kube.get = get
    _reconciler(kube, pools=True).reconcile(sample)
    assert kube.kinds() == {"Deployment", "Service", "PodDisruptionBudget"}
