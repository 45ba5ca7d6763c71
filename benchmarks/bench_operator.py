"""Operator speed on the real control plane (kwok runs the pods), as ratios to a baseline.

Measures, in one run and one namespace:
1. reconcile latency: MMInferenceService created -> its Deployment seen by a watch, p50/p99
   over N resources created one after another; the baseline is the same create -> watch
   latency for a plain Deployment (no operator in the path).
2. time for M resources created at once to all reach Ready=True; the baseline is M plain
   Deployments created at once reaching readyReplicas=1 (kwok, no operator).

Each phase starts from an empty namespace (the previous phase's objects and pods are deleted
first, not measured): the test cluster's two kwok nodes hold 220 pods, fewer than the 300 the
four phases create in all, so leftovers would leave the last phase Pending forever.

Usage:
  .venv/bin/python benchmarks/bench_operator.py [--kubeconfig PATH] [-n 50] [-m 100]
Without --kubeconfig it starts the test control plane (tests/kube/kubecluster, needs
scripts/gotools). Prints one JSON document; --out writes it to a file too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes.client
import kubernetes.watch
import yaml

from mmis_operator import kube as r
from mmis_operator.kube import APPLY, Kube, object_path, service_path
from mmis_operator.main import OperatorThread, Options

ROOT = Path(__file__).resolve().parents[1]


def _service(name: str) -> dict[str, Any]:
    return {
        "apiVersion": r.API_VERSION,
        "kind": r.KIND,
        "metadata": {"name": name},
        "spec": {
            "model": {"id": "bench/model"},
            "replicas": 1,
            "resources": {"gpus": 0, "memory": "1Gi", "cpu": "10m", "frontendMemory": "64Mi",
                          "frontendCpu": "10m"},
            "cache": {"size": "128Mi"},
        },
    }  # fmt: skip


def _deployment(name: str) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "c", "image": "bench.invalid/x:1"}]},
            },
        },
    }


class Seen:
    """Times at which a watch first saw objects satisfy a predicate (name -> monotonic)."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.cond = threading.Condition()

    def mark(self, name: str) -> None:
        with self.cond:
            self.times.setdefault(name, time.monotonic())
            self.cond.notify_all()

    def wait(self, names: set[str], timeout: float) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: names <= self.times.keys(), timeout):
                missing = sorted(names - self.times.keys())[:5]
                raise TimeoutError(f"not seen within {timeout}s: {missing}")


@contextlib.contextmanager
def watching(list_fn: Callable[..., Any], predicate: Callable[[dict[str, Any]], bool],
             **kwargs: Any) -> Iterator[Seen]:  # fmt: skip
    seen, stop = Seen(), threading.Event()

    def loop() -> None:
        while not stop.is_set():
            watch = kubernetes.watch.Watch()
            try:
                # plain dicts: deserializing into the client's models and back cost more CPU
                # than the operator under test, and shares its process (and GIL)
                stream = watch.stream(list_fn, timeout_seconds=5, deserialize=False, **kwargs)
                for event in stream:
                    obj = event["object"]
                    if predicate(obj):
                        seen.mark(obj["metadata"]["name"])
                    if stop.is_set():
                        watch.stop()
            except kubernetes.client.ApiException as exc:
                # a loaded API server's watch cache lags ("Too large resource version", 504)
                # or has moved on (410): list and watch again; marks keep the first time seen
                if exc.status not in (410, 429, 500, 503, 504):
                    raise
            except KeyError as exc:  # the client's ERROR event path with deserialize=False
                if exc.args != ("raw_object",):
                    raise

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(15)


def _ready(obj: dict[str, Any]) -> bool:
    return any(
        c.get("type") == r.READY and c.get("status") == "True"
        for c in (obj.get("status") or {}).get("conditions") or ()
    )


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _install_crd(kube: Kube) -> None:
    crd = yaml.safe_load((ROOT / "crds/mminferenceservice.yaml").read_text())
    path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}"
    query = {"fieldManager": "bench", "force": "true"}
    kube.request("PATCH", path, crd, query, APPLY)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # not measured: wait for the CRD to be served
        got = kube.get(path) or {}
        conds = (got.get("status") or {}).get("conditions") or []
        if any(c["type"] == "Established" and c["status"] == "True" for c in conds):
            return
        time.sleep(0.2)
    raise TimeoutError("the CRD was not established within 60s")


def _api_calls(kube: Kube) -> Counter[str]:
    """The API server's own request counters (``apiserver_request_total``), summed per
    ``VERB resource[/subresource]``: every client's calls (kopf's, the reconciler's, the
    controllers', kwok's), so a phase's delta is its API cost."""
    _, url, headers, _, _ = kube.api.param_serialize(
        "GET", "/metrics", header_params={"Accept": "text/plain"}, auth_settings=["BearerToken"]
    )
    text = kube.api.call_api("GET", url, header_params=headers).read().decode()
    counts: Counter[str] = Counter()
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
        key = f"{labels.get('verb')} {labels.get('resource')}"
        if labels.get("subresource"):
            key += f"/{labels['subresource']}"
        counts[key] += int(float(line.rsplit(" ", 1)[1]))
    return counts


def _delta(before: Counter[str], after: Counter[str], per: int) -> dict[str, float]:
    """Calls per resource in a phase, the largest first (WATCH counts connections only)."""
    diff = after - before
    return {key: round(n / per, 1) for key, n in diff.most_common() if n >= per // 10}


def _clear(kube: Kube, ns: str, timeout: float = 300.0) -> None:
    """Delete every MMInferenceService and Deployment in ``ns``; return once no pod is left."""
    for path in (service_path(ns), object_path("apps/v1", "Deployment", ns)):
        kube.request("DELETE", path, {"propagationPolicy": "Background"})
    pods = f"/api/v1/namespaces/{ns}/pods"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # not measured: polling is fine here
        if not kube.request("GET", pods, query={"limit": "1"}).get("items"):
            services = kube.request("GET", service_path(ns), query={"limit": "1"})
            if not services.get("items"):
                return
        kube.request("DELETE", pods, query={"gracePeriodSeconds": "0"})
        time.sleep(1.0)
    raise TimeoutError(f"namespace {ns} still has objects after {timeout}s")


def run(kubeconfig: Path, n: int, m: int) -> dict[str, Any]:
    kube = Kube.from_kubeconfig(kubeconfig)
    apps = kubernetes.client.AppsV1Api(kube.api)
    custom = kubernetes.client.CustomObjectsApi(kube.api)
    ns = f"bench-{uuid.uuid4().hex[:8]}"
    kube.request("POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
    _install_crd(kube)
    deps = object_path("apps/v1", "Deployment", ns)
    result: dict[str, Any] = {"n": n, "m": m}
    try:
        with watching(apps.list_namespaced_deployment, lambda o: True, namespace=ns) as seen:
            base = []
            for i in range(n):
                name = f"plain-{i}"
                start = time.monotonic()
                kube.request("POST", deps, _deployment(name))
                seen.wait({name}, 30)
                base.append(seen.times[name] - start)
        _clear(kube, ns)
        options = Options(namespaces=(ns,), resync_seconds=3600.0)
        with OperatorThread(kubeconfig, options):
            # the watch of phase 1 ends with it: it must not load the process in phase 2
            with watching(apps.list_namespaced_deployment, lambda o: True, namespace=ns) as seen:
                lat = []
                for i in range(n):
                    name = f"svc-{i}"
                    start = time.monotonic()
                    kube.request("POST", service_path(ns), _service(name))
                    seen.wait({name}, 60)
                    lat.append(seen.times[name] - start)
            _clear(kube, ns)
            result["reconcile_p50_s"] = _pct(lat, 0.5)
            result["reconcile_p99_s"] = _pct(lat, 0.99)
            result["baseline_create_p50_s"] = _pct(base, 0.5)
            result["reconcile_p50_ratio"] = (
                result["reconcile_p50_s"] / result["baseline_create_p50_s"]
            )

            ready_ns = lambda o: (o.get("status") or {}).get("readyReplicas") == 1  # noqa: E731
            with watching(apps.list_namespaced_deployment, ready_ns, namespace=ns) as ready:
                calls = _api_calls(kube)
                start = time.monotonic()
                names = {f"bulk-plain-{i}" for i in range(m)}
                for name in names:
                    kube.request("POST", deps, _deployment(name))
                ready.wait(names, 600)
                result["baseline_m_ready_s"] = max(ready.times[x] for x in names) - start
                result["baseline_calls_per_resource"] = _delta(calls, _api_calls(kube), m)
            _clear(kube, ns)
            with watching(custom.list_namespaced_custom_object, _ready, group=r.GROUP,
                          version=r.VERSION, namespace=ns, plural=r.PLURAL) as ready:  # fmt: skip
                calls = _api_calls(kube)
                start = time.monotonic()
                names = {f"bulk-{i}" for i in range(m)}
                for name in names:
                    kube.request("POST", service_path(ns), _service(name))
                ready.wait(names, 900)
                result["m_ready_s"] = max(ready.times[x] for x in names) - start
                result["calls_per_resource"] = _delta(calls, _api_calls(kube), m)
            result["m_ready_ratio"] = result["m_ready_s"] / result["baseline_m_ready_s"]
            result["reconcile_mean_s"] = statistics.fmean(lat)
    finally:
        kube.delete(f"/api/v1/namespaces/{ns}")
        kube.close()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", type=Path)
    parser.add_argument("-n", type=int, default=50, help="resources for the latency percentiles")
    parser.add_argument("-m", type=int, default=100, help="resources created at once")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.kubeconfig:
        result = run(args.kubeconfig, args.n, args.m)
    else:
        sys.path.insert(0, str(ROOT / "tests" / "kube"))
        from kubecluster import Cluster, find_tools

        with Cluster(find_tools(build=False)) as cluster:
            result = run(cluster.kubeconfig, args.n, args.m)
    text = json.dumps(result, indent=2)
    print(text)
    res = result
    print(
        f"SUMMARY reconcile p50 {res['reconcile_p50_s'] * 1000:.0f} ms"
        f" (p99 {res['reconcile_p99_s'] * 1000:.0f} ms; plain create->watch"
        f" {res['baseline_create_p50_s'] * 1000:.0f} ms; ratio {res['reconcile_p50_ratio']:.2f});"
        f" {res['m']} to Ready {res['m_ready_s']:.1f} s vs {res['baseline_m_ready_s']:.1f} s"
        f" plain (ratio {res['m_ready_ratio']:.2f})"
    )
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
