"""spec.autoscaling / spec.monitoring: parsing, the pure builders (HPA, KEDA ScaledObject,
PodMonitor, scrape annotations), discovery and which integrations a reconcile applies or
deletes (an in-memory API; the real control plane is in tests/kube/test_integrations_mmis.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from mmis_operator import builders, reconciler
from mmis_operator.kube import KubeError
from mmis_operator.reconciler import Discovery, Integrations, Reconciler
from mmis_operator.spec import KV_USAGE, InvalidSpecError, parse_spec

AUTO = {"enabled": True, "minReplicas": 2, "maxReplicas": 6, "target": 4}


def _owner(sample: dict[str, Any], **spec: Any) -> dict[str, Any]:
    obj = copy.deepcopy(sample)
    obj["spec"].update(spec)
    return obj


def test_off_unless_enabled(sample: dict[str, Any]) -> None:
    assert parse_spec(sample["spec"]).autoscaling is None
    off = _owner(sample, autoscaling={**AUTO, "enabled": False})["spec"]
    assert parse_spec(off).autoscaling is None
    assert builders.autoscaler(sample, parse_spec(off), "HorizontalPodAutoscaler") is None


@pytest.mark.parametrize(
    ("auto", "field", "words"),
    [
        ({"enabled": True, "target": 1}, "spec.autoscaling.maxReplicas", "required"),
        ({"enabled": True, "maxReplicas": 3}, "spec.autoscaling.target", "required"),
        ({**AUTO, "minReplicas": 7}, "spec.autoscaling", "must not exceed"),
        ({**AUTO, "metric": "vllm:foo"}, "spec.autoscaling.metric", "mmis:num_requests_waiting"),
        ({**AUTO, "target": 0}, "spec.autoscaling.target", "positive"),
        ({**AUTO, "metric": KV_USAGE, "target": 80}, "spec.autoscaling.target", "0.8"),
        ({**AUTO, "scaleDownStabilizationSeconds": -1}, "spec.autoscaling.scaleDown", "seconds"),
        ({**AUTO, "minReplicas": 0}, "spec.autoscaling.minReplicas", "[1, 1000]"),
    ],
)
def test_invalid_autoscaling_names_the_field(
    sample: dict[str, Any], auto: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(InvalidSpecError, match=words) as info:
        parse_spec(_owner(sample, autoscaling=auto)["spec"])
    assert info.value.field.startswith(field)


def test_hpa_targets_the_resources_scale_subresource(sample: dict[str, Any]) -> None:
    owner = _owner(sample, autoscaling={**AUTO, "scaleDownStabilizationSeconds": 600})
    hpa = builders.autoscaler(owner, parse_spec(owner["spec"]), "HorizontalPodAutoscaler")
    assert hpa is not None
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    body = hpa["spec"]
    ref = {"apiVersion": "mmis.dev/v1alpha1", "kind": "MMInferenceService", "name": "llava"}
    assert body["scaleTargetRef"] == ref
    assert (body["minReplicas"], body["maxReplicas"]) == (2, 6)
    (metric,) = body["metrics"]
    assert metric == {
        "type": "Pods",
        "pods": {
            "metric": {"name": "mmis:num_requests_waiting"},
            "target": {"type": "AverageValue", "averageValue": "4"},
        },
    }
    assert body["behavior"]["scaleDown"] == {"stabilizationWindowSeconds": 600}
    assert body["behavior"]["scaleUp"] == {"stabilizationWindowSeconds": 0}


def test_kv_usage_target_is_a_milli_quantity(sample: dict[str, Any]) -> None:
    owner = _owner(sample, autoscaling={**AUTO, "metric": KV_USAGE, "target": 0.8})
    hpa = builders.autoscaler(owner, parse_spec(owner["spec"]), "HorizontalPodAutoscaler")
    assert hpa is not None
    target = hpa["spec"]["metrics"][0]["pods"]["target"]
    assert target["averageValue"] == "800m"
    assert builders.quantity(2.5) == "2500m" and builders.quantity(3.0) == "3"


def test_scaled_object_has_a_prometheus_trigger(sample: dict[str, Any]) -> None:
    owner = _owner(sample, autoscaling={**AUTO, "prometheusAddress": "http://prom:9090"})
    so = builders.autoscaler(owner, parse_spec(owner["spec"]), "ScaledObject")
    assert so is not None
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    body = so["spec"]
    assert body["scaleTargetRef"]["kind"] == "MMInferenceService"
    assert (body["minReplicaCount"], body["maxReplicaCount"]) == (2, 6)
    (trigger,) = body["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    meta = trigger["metadata"]
    assert meta["serverAddress"] == "http://prom:9090"
    assert meta["threshold"] == "4"
    query = 'sum(mmis:num_requests_waiting{namespace="ml",pod=~"llava-[a-z0-9]+-[a-z0-9]+"})'
    assert meta["query"] == query
    assert body["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"] == {
        "stabilizationWindowSeconds": 300
    }


def test_deployment_replicas_stay_within_the_autoscalers_bounds(sample: dict[str, Any]) -> None:
    for replicas, expected in ((0, 2), (4, 4), (9, 6)):
        owner = _owner(sample, replicas=replicas, autoscaling=AUTO)
        dep = builders.deployment(owner, parse_spec(owner["spec"]))
        assert dep["spec"]["replicas"] == expected
    assert builders.deployment(sample, parse_spec(sample["spec"]))["spec"]["replicas"] == 2


def test_scrape_annotations_and_pod_monitor(sample: dict[str, Any]) -> None:
    spec = parse_spec(sample["spec"])
    annotations = builders.deployment(sample, spec)["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "8001"
    assert annotations["prometheus.io/path"] == "/metrics"
    pm = builders.pod_monitor(sample, spec)
    assert pm is not None and pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["spec"]["selector"]["matchLabels"]["mmis.dev/service"] == "llava"
    assert pm["spec"]["podMetricsEndpoints"] == [
        {"port": "ops", "path": "/metrics", "interval": "15s"}
    ]
    assert pm["metadata"]["ownerReferences"][0]["kind"] == "MMInferenceService"
    off = parse_spec({**sample["spec"], "monitoring": {"podMonitor": False,
                                                       "scrapeAnnotations": False}})  # fmt: skip
    assert builders.pod_monitor(sample, off) is None
    template = builders.deployment(sample, off)["spec"]["template"]["metadata"]
    assert not any(k.startswith("prometheus.io/") for k in template["annotations"])
    with pytest.raises(InvalidSpecError, match="duration"):
        parse_spec({**sample["spec"], "monitoring": {"interval": "soon"}})


def test_integration_settings_from_the_environment() -> None:
    assert Integrations.from_env({}) == Integrations("auto", "auto")
    env = {reconciler.ENV_AUTOSCALER: "KEDA", reconciler.ENV_POD_MONITORS: "off"}
    assert Integrations.from_env(env) == Integrations("keda", "off")
    with pytest.raises(ValueError, match=reconciler.ENV_AUTOSCALER):
        Integrations.from_env({reconciler.ENV_AUTOSCALER: "vpa"})


class FakeApi:
    """Discovery answers, server-side applies and deletes, recorded; no status writes."""

    def __init__(self, obj: dict[str, Any], groups: dict[str, list[str]]) -> None:
        self.obj, self.groups = obj, groups
        self.objects: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []

    def get(self, path: str) -> dict[str, Any] | None:
        self.calls.append(f"GET {path}")
        if path.startswith("/apis/") and path.count("/") == 3:  # /apis/GROUP/VERSION
            names = self.groups.get(path.removeprefix("/apis/"))
            return None if names is None else {"resources": [{"name": n} for n in names]}
        return copy.deepcopy(self.objects.get(path))

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        from mmis_operator.kube import object_path

        meta = manifest["metadata"]
        path = object_path(
            manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"]
        )
        self.calls.append(f"APPLY {manifest['kind']}")
        self.objects[path] = copy.deepcopy(manifest)
        return copy.deepcopy(manifest)

    def delete(self, path: str) -> None:
        self.calls.append(f"DELETE {path}")
        self.objects.pop(path, None)

    def kinds(self) -> set[str]:
        return {o["kind"] for o in self.objects.values()}


class QuietReconciler(Reconciler):
    def write_status(self, *args: Any, **kwargs: Any) -> None:
        return None


KEDA = {"keda.sh/v1alpha1": ["scaledobjects", "scaledobjects/status"]}
PROM = {"monitoring.coreos.com/v1": ["podmonitors", "servicemonitors"]}


def _reconciler(api: FakeApi, settings: Integrations | None = None) -> Reconciler:
    settings = settings or Integrations()
    return QuietReconciler(api, integrations=settings, discovery=Discovery(api))  # type: ignore[arg-type]


def test_reconcile_applies_an_hpa_without_keda_then_deletes_it(sample: dict[str, Any]) -> None:
    api = FakeApi(_owner(sample, autoscaling=AUTO), groups={})
    rec = _reconciler(api)
    rec.reconcile(api.obj)
    assert "HorizontalPodAutoscaler" in api.kinds()
    assert not {"ScaledObject", "PodMonitor"} & api.kinds()  # their CRDs are not served
    api.obj["spec"]["autoscaling"] = {**AUTO, "enabled": False}
    rec.reconcile(api.obj)
    assert "HorizontalPodAutoscaler" not in api.kinds()
    api.calls.clear()
    rec.reconcile(api.obj)  # steady state: no discovery, no look for what was never applied
    assert not any(
        "horizontalpodautoscalers" in c or c.startswith("GET /apis/k") for c in api.calls
    )


def test_reconcile_prefers_keda_and_creates_pod_monitors(sample: dict[str, Any]) -> None:
    api = FakeApi(_owner(sample, autoscaling=AUTO), groups={**KEDA, **PROM})
    _reconciler(api).reconcile(api.obj)
    assert {"ScaledObject", "PodMonitor"} <= api.kinds()
    assert "HorizontalPodAutoscaler" not in api.kinds()
    forced = FakeApi(_owner(sample, autoscaling=AUTO), groups={**KEDA, **PROM})
    _reconciler(forced, Integrations(autoscaler="hpa", pod_monitors="off")).reconcile(forced.obj)
    assert "HorizontalPodAutoscaler" in forced.kinds()
    assert not {"ScaledObject", "PodMonitor"} & forced.kinds()


def test_discovery_is_cached_and_an_outage_is_not_absence() -> None:
    now = [0.0]
    api = FakeApi({}, groups=PROM)
    found = Discovery(api, ttl=60, clock=lambda: now[0])  # type: ignore[arg-type]
    assert found.pod_monitors() and not found.keda()
    assert len(api.calls) == 2
    found.pod_monitors()
    assert len(api.calls) == 2  # cached
    now[0] = 61.0
    api.groups = {}  # the CRD was removed
    assert not found.pod_monitors()

    class Down(FakeApi):
        def get(self, path: str) -> dict[str, Any] | None:
            raise KubeError(0, "connection refused", "NoResponse")

    with pytest.raises(KubeError):
        Discovery(Down({}, {})).keda()  # type: ignore[arg-type]
