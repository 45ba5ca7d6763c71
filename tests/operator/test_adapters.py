"""``spec.adapters`` (issue 47 Build 4, the operator): parsed, turned into ``--enable-lora`` and
volumes, and pushed to the running pods through P0's internal LoRA routes.

- Parsing: every source form resolves to the path the pod loads; bad names, sources,
  duplicates, the base model's name and ``maxCpuLoras < maxLoras`` each name their field.
- Golden: golden/children_adapters.json holds the Deployment of a resource with a path, a
  pvc:// and an hf:// adapter and the engine's LoRA limits, byte for byte.
- The pod template never depends on the list, only on its presence and on which claims it
  names (two different lists with the same claims: the same Deployment).
- The internal token is derived from the operator's key, the namespace, name and uid, and the
  reconciler writes that token into ``NAME-internal`` (create only); without a key it creates
  no Secret for adapters alone, and P0's reference to it is optional.
- The plan (load missing, reload a changed path, unload extras) and one probe cycle against a
  real HTTP server standing in for P0: the calls, their bearer token, ``status.adapters``, a
  refused call and a pod without LoRA reported per replica, nothing raised.
- A pod that turns Ready is pushed the list at once, once per Ready spell (uid and the Ready
  condition's lastTransitionTime), only that pod, and only its ``status.adapters`` entry is
  written (the other ready pods' kept, the gone pods' dropped).

The real API server's CEL rules: tests/kube/test_crd_mmis.py; a real ``mmis serve`` taking an
adapter without a restart: tests/kube/test_adapters_mmis.py.

Regenerate the golden file (only for an intended change; review the diff and say in the commit
what changed): ``.venv/bin/python tests/operator/test_adapters.py --write-golden NOTE``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import hmac
import http.server
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mmis_operator import adapters, builders, main, routing
from mmis_operator import kube as r
from mmis_operator.adapters import Action, plan
from mmis_operator.probe import OVERRIDE_ANNOTATION, Arrivals, CoherenceProbe, with_replicas
from mmis_operator.reconciler import Integrations, Reconciler, Security
from mmis_operator.spec import AdapterSpec, InvalidSpecError, parse_spec
from mmis_operator.status import PodStats

GOLDEN = Path(__file__).resolve().parent / "golden" / "children_adapters.json"
ADAPTERS = [
    {"name": "tenant-a", "source": "/var/cache/mmis/adapters/a"},
    {"name": "org/tenant-b", "source": "pvc://lora-store/b/v2"},
    {"name": "tenant-c", "source": "hf://acme/llava-lora@v1"},
]
RESOURCE: dict[str, Any] = {
    "apiVersion": "mmis.dev/v1alpha1",
    "kind": "MMInferenceService",
    "metadata": {"name": "llava", "namespace": "ml", "uid": "uid-golden"},
    "spec": {
        "model": {"id": "llava-hf/llava-1.5-7b-hf", "tokenSecretRef": {"name": "hf"}},
        "resources": {"gpus": 1, "memory": "32Gi"},
        "engine": {"maxLoras": 2, "maxLoraRank": 32, "maxCpuLoras": 4},
        "adapters": ADAPTERS,
    },
}


def _bytes(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode()


def _deployment(resource: dict[str, Any]) -> dict[str, Any]:
    return builders.deployment(resource, parse_spec(resource["spec"]))


def write_golden(note: str) -> None:
    """Rewrite the golden Deployment from today's builders, ``note`` appended."""
    old = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"_note": ""}
    data = {
        "_note": f"{old['_note']} {note}".strip(),
        "resource": RESOURCE,
        "deployment": _deployment(RESOURCE),
    }
    GOLDEN.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def test_the_deployment_is_byte_identical_to_the_golden_file() -> None:
    golden = json.loads(GOLDEN.read_text())
    assert golden["resource"] == RESOURCE
    assert _bytes(_deployment(RESOURCE)) == _bytes(golden["deployment"])


# --- Parsing --------------------------------------------------------------------------------


def test_each_source_form_resolves_to_what_the_pod_loads() -> None:
    spec = parse_spec(RESOURCE["spec"])
    assert spec.adapters == (
        AdapterSpec("tenant-a", "/var/cache/mmis/adapters/a", "/var/cache/mmis/adapters/a"),
        AdapterSpec(
            "org/tenant-b",
            "pvc://lora-store/b/v2",
            "/mnt/mmis-adapters/lora-store/b/v2",
            "lora-store",
        ),
        AdapterSpec("tenant-c", "hf://acme/llava-lora@v1", "hf://acme/llava-lora@v1"),
    )
    assert parse_spec({"model": {"id": "m"}}).adapters is None
    assert parse_spec({"model": {"id": "m"}, "adapters": []}).adapters == ()


def _with_adapters(items: Any, **engine: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": {"id": "m", "servedName": "base"}, "adapters": items}
    if engine:
        spec["engine"] = engine
    return spec


@pytest.mark.parametrize(
    ("spec", "field", "words"),
    [
        (_with_adapters({"a": "/x"}), "spec.adapters", "list"),
        (_with_adapters(["a"]), "spec.adapters[0]", "name and source"),
        (_with_adapters([{"name": "a b", "source": "/x"}]), "spec.adapters[0].name", "model name"),
        (_with_adapters([{"name": "a,b", "source": "/x"}]), "spec.adapters[0].name", "letters"),
        (_with_adapters([{"source": "/x"}]), "spec.adapters[0].name", "model name"),
        (_with_adapters([{"name": "base", "source": "/x"}]), "spec.adapters[0].name", "served"),
        (
            _with_adapters([{"name": "a", "source": "/x"}, {"name": "a", "source": "/y"}]),
            "spec.adapters[1].name",
            "twice",
        ),
        (_with_adapters([{"name": "a", "source": "x/y"}]), "spec.adapters[0].source", "absolute"),
        (_with_adapters([{"name": "a", "source": "/m/../etc"}]), "spec.adapters[0].source", "pvc"),
        (
            _with_adapters([{"name": "a", "source": "pvc://Claim/x"}]),
            "spec.adapters[0].source",
            "hf",
        ),
        (
            _with_adapters([{"name": "a", "source": "pvc://claim"}]),
            "spec.adapters[0].source",
            "PATH",
        ),
        (_with_adapters([{"name": "a", "source": "hf://acme"}]), "spec.adapters[0].source", "ORG"),
        (_with_adapters([{"name": "a", "source": "s3://b/k"}]), "spec.adapters[0].source", "hf://"),
        (_with_adapters([{"name": "a"}]), "spec.adapters[0].source", "absolute path"),
        (_with_adapters([], maxLoras=4, maxCpuLoras=2), "spec.engine.maxCpuLoras", "at least"),
        (_with_adapters([], maxLoraRank=0), "spec.engine.maxLoraRank", "at least 1"),
    ],
)
def test_invalid_adapters_name_the_field(spec: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        parse_spec(spec)
    assert info.value.field == field
    assert words in str(info.value)


# --- The pod template -----------------------------------------------------------------------


def _template(adapters_list: Any) -> dict[str, Any]:
    resource = copy.deepcopy(RESOURCE)
    if adapters_list is None:
        del resource["spec"]["adapters"]
    else:
        resource["spec"]["adapters"] = adapters_list
    return dict(_deployment(resource)["spec"]["template"])


def _containers(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in template["spec"]["containers"]}


def test_the_list_never_changes_the_pod_template() -> None:
    one = _template(ADAPTERS)
    other = _template(
        [
            {"name": "x", "source": "pvc://lora-store/elsewhere"},
            {"name": "tenant-a", "source": "/var/cache/mmis/adapters/a-v2"},
        ]
    )
    assert _bytes(one) == _bytes(other)
    # presence turns LoRA on (once); an empty list is presence
    empty, absent = _template([]), _template(None)
    assert "--enable-lora" in _containers(empty)[r.ENGINE]["args"]
    assert "--enable-lora" not in _containers(absent)[r.ENGINE]["args"]
    # a claim not mounted yet is a template change: its volume, read-only in both containers
    assert [v["name"] for v in one["spec"]["volumes"]][-1] == "lora-lora-store"
    assert one["spec"]["volumes"][-1]["persistentVolumeClaim"] == {
        "claimName": "lora-store",
        "readOnly": True,
    }
    for box in _containers(one).values():
        mount = box["volumeMounts"][-1]
        assert mount == {
            "name": "lora-lora-store",
            "mountPath": "/mnt/mmis-adapters/lora-store",
            "readOnly": True,
        }
    assert not any(v["name"].startswith("lora-") for v in empty["spec"]["volumes"])


def test_p0_reads_the_internal_token_optionally_for_adapters_alone() -> None:
    env = _containers(_template([]))[r.FRONTEND]["env"]
    (token,) = [e for e in env if e["name"] == routing.FRONTEND_TOKEN_ENV]
    ref = token["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "llava-internal", "key": routing.TOKEN_KEY, "optional": True}
    absent = _containers(_template(None))[r.FRONTEND]["env"]
    assert routing.FRONTEND_TOKEN_ENV not in {e["name"] for e in absent}


def test_p0_downloads_hub_adapters_with_the_models_token_and_the_engine_stays_offline() -> None:
    boxes = _containers(_template([]))
    front = {e["name"]: e for e in boxes[r.FRONTEND]["env"]}
    engine = {e["name"]: e for e in boxes[r.ENGINE]["env"]}
    assert "HF_HUB_OFFLINE" not in front
    assert front["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert engine["HF_HUB_OFFLINE"]["value"] == "1" and "HF_TOKEN" not in engine
    plain = {e["name"]: e for e in _containers(_template(None))[r.FRONTEND]["env"]}
    assert plain["HF_HUB_OFFLINE"]["value"] == "1" and "HF_TOKEN" not in plain


# --- The internal token ---------------------------------------------------------------------


def test_the_token_is_an_hmac_of_namespace_name_and_uid() -> None:
    token = adapters.internal_token("k3y", "ml", "llava", "uid-1")
    expected = hmac.new(b"k3y", b"ml/llava/uid-1", hashlib.sha256).hexdigest()
    assert token == expected and len(token) == 64
    assert adapters.internal_token("k3y", "ml", "llava", "uid-2") != token
    assert adapters.internal_token("other", "ml", "llava", "uid-1") != token


class _NoDiscovery:
    def keda(self) -> bool:
        return False

    def pod_monitors(self) -> bool:
        return False

    def inference_pools(self) -> bool:
        return False


def _reconcile(factory: Any, resource: dict[str, Any], security: Security) -> Any:
    kube = factory(resource)
    Reconciler(
        kube,
        integrations=Integrations(autoscaler="hpa", pod_monitors="off"),
        discovery=_NoDiscovery(),  # type: ignore[arg-type]
        security=security,
    ).reconcile(resource)
    return kube


def test_the_reconciler_writes_the_derived_token_with_a_key(
    sample: dict[str, Any], kube_factory: Any
) -> None:
    sample["spec"]["adapters"] = [{"name": "a", "source": "/var/cache/mmis/a"}]
    kube = _reconcile(kube_factory, copy.deepcopy(sample), Security(internal_key="k3y"))
    secret = kube.children["/api/v1/namespaces/ml/secrets/llava-internal"]
    assert secret["stringData"] == {"token": adapters.internal_token("k3y", "ml", "llava", "uid-1")}
    # without a key: no Secret for adapters alone (the operator may not create one)
    bare = _reconcile(kube_factory, copy.deepcopy(sample), Security())
    assert not [p for p in bare.created if "/secrets/" in p]


# --- The plan and one probe cycle -----------------------------------------------------------

A = AdapterSpec("a", "/m/a", "/m/a")
B = AdapterSpec("b", "pvc://c/b", "/mnt/mmis-adapters/c/b", "c")


def test_plan_loads_missing_reloads_changed_and_unloads_extras() -> None:
    assert plan([A, B], {"a": "/m/a", "b": "/mnt/mmis-adapters/c/b"}) == []
    assert plan([A, B], {}) == [Action("load", "a", "/m/a"), Action("load", "b", B.path)]
    assert plan([A], {"a": "/m/old", "x": "/m/x"}) == [
        Action("unload", "x"),
        Action("unload", "a"),
        Action("load", "a", "/m/a"),
    ]
    assert plan([], {"a": "/m/a"}) == [Action("unload", "a")]


def test_held_reads_the_stats_answer() -> None:
    answer = {"lora": {"adapters": [{"name": "a", "path": "/m/a"}], "max_loras": 2}}
    assert adapters.held(answer) == {"a": "/m/a"}
    assert adapters.held({"drift_rate": 0}) is None
    with pytest.raises(ValueError):
        adapters.held({"lora": {"adapters": "a"}})


_STATS_FIELDS = [f.name for f in dataclasses.fields(PodStats)]


class _P0(http.server.BaseHTTPRequestHandler):
    """P0's ops port: ``/stats/cache`` with ``holding``, the internal LoRA routes (recorded;
    ``refuse`` names an adapter whose load answers 400)."""

    holding: dict[str, str] = {}
    calls: list[tuple[str, dict[str, Any], str | None]] = []
    refuse: str = ""
    lora = True

    def _send(self, code: int, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:
        stats: dict[str, Any] = dict.fromkeys(_STATS_FIELDS, 0.0)
        if type(self).lora:
            items = [{"name": n, "path": p} for n, p in sorted(self.holding.items())]
            stats["lora"] = {"adapters": items, "max_loras": 2}
        self._send(200, stats)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls.append((self.path, body, self.headers.get("Authorization")))
        if body["lora_name"] == type(self).refuse:
            self._send(400, {"error": {"message": "no adapter_config.json in /m/bad"}})
            return
        if self.path.endswith("/load_lora_adapter"):
            self.holding[body["lora_name"]] = body["lora_path"]
        else:
            self.holding.pop(body["lora_name"], None)
        self._send(200, {})

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def p0() -> Iterator[str]:
    _P0.holding, _P0.calls, _P0.refuse, _P0.lora = {"x": "/m/x"}, [], "", True
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _P0)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _pod(name: str) -> dict[str, Any]:
    ready = {"type": "Ready", "status": "True"}
    return {"metadata": {"name": name}, "status": {"podIP": "10.0.0.1", "conditions": [ready]}}


async def _cycle(store: Any, url: str, key: str | None, wanted: Any) -> dict[str, Any]:
    body = copy.deepcopy(store.obj)
    body["metadata"]["annotations"] = {OVERRIDE_ANNOTATION: url}
    probe = CoherenceProbe(store, timeout=2.0, allow_override=True, internal_key=key)
    probe.list_pods = lambda *_: [_pod("llava-0")]  # type: ignore[method-assign]
    await probe.run(body, 0.05, wanted)
    return dict(store.obj.get("status") or {})


async def test_a_cycle_brings_the_pod_to_the_list_with_the_derived_token(
    store: Any, p0: str
) -> None:
    status = await _cycle(store, p0, "k3y", [A, B])
    token = adapters.internal_token("k3y", "ml", "llava", "uid-1")
    assert [(path, body["lora_name"]) for path, body, _ in _P0.calls] == [
        ("/internal/unload_lora_adapter", "x"),
        ("/internal/load_lora_adapter", "a"),
        ("/internal/load_lora_adapter", "b"),
    ]
    assert {auth for *_, auth in _P0.calls} == {f"Bearer {token}"}
    assert status["adapters"] == [{"pod": "llava-0", "adapters": ["a", "b"]}]
    _P0.calls.clear()
    await _cycle(store, p0, "k3y", [A, B])  # nothing to do: no call
    assert _P0.calls == []
    await _cycle(store, p0, "k3y", None)  # spec.adapters gone: no call, status dropped
    assert _P0.calls == [] and "adapters" not in store.obj["status"]


async def test_failures_are_reported_per_replica_never_raised(store: Any, p0: str) -> None:
    _P0.refuse = "b"
    status = await _cycle(store, p0, "k3y", [B, A])
    (entry,) = status["adapters"]
    assert entry["adapters"] == ["a"]  # x unloaded, b refused, a loaded all the same
    assert entry["error"] == "load b: 400 no adapter_config.json in /m/bad"
    assert [body["lora_name"] for _, body, _ in _P0.calls] == ["x", "b", "a"]
    # a reload whose unload is refused (in use) skips its load; the rest goes on
    _P0.holding, _P0.calls, _P0.refuse = {"a": "/m/old"}, [], "a"
    (entry,) = (await _cycle(store, p0, "k3y", [A, B]))["adapters"]
    assert [(p.rsplit("/", 1)[1], b["lora_name"]) for p, b, _ in _P0.calls] == [
        ("unload_lora_adapter", "a"),
        ("load_lora_adapter", "b"),
    ]
    assert entry["adapters"] == ["a", "b"] and entry["error"].startswith("unload a: 400")
    # no key: nothing sent, the entry names the chart value and the flag
    _P0.calls.clear()
    (entry,) = (await _cycle(store, p0, None, [A, B, AdapterSpec("c", "/m/c", "/m/c")]))["adapters"]
    assert _P0.calls == [] and "adapters.enabled=true" in entry["error"]
    assert "--internal-key" in entry["error"]
    # a pod without LoRA, and a pod that does not answer
    _P0.lora = False
    (entry,) = (await _cycle(store, p0, "k3y", [A]))["adapters"]
    assert entry == {"pod": "llava-0", "adapters": [], "error": adapters.NO_LORA}
    (entry,) = (await _cycle(store, "http://127.0.0.1:9", "k3y", [A]))["adapters"]
    assert entry["error"].startswith("/stats/cache: ConnectError")


def _spell(name: str, since: str, ready: bool = True, uid: str = "") -> dict[str, Any]:
    pod = _pod(name)
    pod["metadata"]["uid"] = uid or f"uid-{name}"
    cond = {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": since}
    pod["status"]["conditions"] = [cond]
    return pod


def test_a_pod_arrives_once_per_ready_spell() -> None:
    seen = Arrivals()
    assert seen.arrived(_spell("p", "t0", ready=False)) is False
    assert seen.arrived(_spell("p", "t1")) is True  # turned Ready
    assert seen.arrived(_spell("p", "t1")) is False  # another event of the Ready pod
    assert seen.arrived(_spell("p", "t2")) is True  # a flap batched into one event
    assert seen.arrived(_spell("p", "t3", ready=False)) is False
    assert seen.arrived(_spell("p", "t3")) is True  # Ready again (without a new time too)
    assert seen.arrived(_spell("p", "t3", uid="other")) is True  # a new pod of the same name
    going = _spell("q", "t1")
    going["metadata"]["deletionTimestamp"] = "t9"
    assert seen.arrived(going) is False  # terminating: not ready
    seen.forget(_spell("p", "t3"))
    assert seen.arrived(_spell("p", "t3")) is True


def test_with_replicas_replaces_keeps_and_drops_entries() -> None:
    current = [{"pod": "b", "adapters": ["x"]}, {"pod": "gone", "adapters": []}]
    fresh = [{"pod": "a", "adapters": ["y"], "error": "e"}]
    assert with_replicas(current, fresh, {"a", "b"}) == [fresh[0], current[0]]
    assert with_replicas([], [], {"a"}) == []


async def test_a_pod_that_turns_ready_gets_the_list_at_once_and_alone(store: Any, p0: str) -> None:
    store.obj["metadata"]["annotations"] = {OVERRIDE_ANNOTATION: f"{p0},{p0}"}
    store.obj["spec"]["adapters"] = [{"name": "a", "source": "/m/a"}]
    others = [{"pod": "llava-0", "adapters": ["x"]}, {"pod": "llava-gone", "adapters": []}]
    store.obj["status"] = {"adapters": others}
    probe = CoherenceProbe(store, timeout=2.0, allow_override=True, internal_key="k3y")
    new = _spell("llava-1", "t1")
    probe.list_pods = lambda *_: [_spell("llava-0", "t0"), new]  # type: ignore[method-assign]
    key = ("ml", "llava")

    async def seen(pod: dict[str, Any]) -> list[tuple[str, str]]:
        _P0.calls.clear()
        probe.pod_seen(key, pod)
        await probe.idle()
        return [(path.rsplit("/", 1)[1], body["lora_name"]) for path, body, _ in _P0.calls]

    # llava-0 stands on the same server: a push to it too would call twice
    assert await seen(new) == [("unload_lora_adapter", "x"), ("load_lora_adapter", "a")]
    assert store.obj["status"]["adapters"] == [others[0], {"pod": "llava-1", "adapters": ["a"]}]
    _P0.holding.clear()  # the pod lost it: only a new Ready spell or the tick repairs it
    assert await seen(new) == []  # another event of the same Ready pod: nothing
    assert await seen(_spell("llava-1", "t2")) == [("load_lora_adapter", "a")]
    _P0.holding.clear()
    del store.obj["spec"]["adapters"]
    assert await seen(_spell("llava-1", "t3")) == []  # no spec.adapters: no call
    probe.pod_seen(key, _spell("llava-1", "t3"), deleted=True)
    assert probe.arrivals.arrived(_spell("llava-1", "t3")) is True  # forgotten on DELETED


# --- The chart: adapters.enabled ------------------------------------------------------------


def test_the_charts_adapters_value_makes_the_key_and_grants_only_secret_create() -> None:
    """adapters.enabled: a generated key in ``<fullname>-internal-key`` that the operator gets
    as INTERNAL_KEY_ENV (never a flag), and exactly one more rule per operator role (create
    Secrets: NAME-internal); off, none of the three. The operator reads the env."""
    from tests.security.test_rbac import CHART, _docs, _rules, violations

    plain, enabled = _docs(CHART), _docs(CHART, "--set", "adapters.enabled=true")
    rules: dict[str, list[Any]] = {where: [] for where, _ in _rules(enabled)}
    for where, rule in _rules(enabled):
        rules[where].append(rule)
    for where, rule in _rules(plain):
        rules[where].remove(rule)
    secret = {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}
    assert rules == {where: [secret] for where in rules} and rules
    assert violations(enabled, routing_enabled=True) == []  # secrets: create only
    (key,) = [d for d in enabled if d["kind"] == "Secret"]
    assert key["metadata"]["name"].endswith("-internal-key") and len(key["data"]["key"]) > 64
    assert not [d for d in plain if d["kind"] == "Secret"]

    def env(docs: list[dict[str, Any]]) -> dict[str, Any]:
        (dep,) = [d for d in docs if d["kind"] == "Deployment"]
        (box,) = dep["spec"]["template"]["spec"]["containers"]
        assert not any("internal-key" in a for a in box["args"])
        return {e["name"]: e for e in box["env"]}

    ref = env(enabled)[main.INTERNAL_KEY_ENV]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": key["metadata"]["name"], "key": "key"}
    assert main.INTERNAL_KEY_ENV not in env(plain)
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    environ = {main.INTERNAL_KEY_ENV: "k3y"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(main.os, "environ", environ)
        assert main.options_from_args(parser.parse_args([])).security().internal_key == "k3y"
    assert "k3y" not in repr(main.options_from_args(parser.parse_args(["--internal-key", "k3y"])))


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--write-golden":
        sys.exit("usage: test_adapters.py --write-golden NOTE")
    write_golden(sys.argv[2])
