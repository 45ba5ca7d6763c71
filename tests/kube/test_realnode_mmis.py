"""mmis in real pods: the chart's operator and an MMInferenceService on a real kubelet.

One real node (``kubecluster/realnode.py``), the operator installed by ``helm install`` as a
real pod, and one tiny-model service in a namespace that enforces Pod Security
``restricted``; the tests then walk issue 32's points in order on that one service (each
waits for the state it needs, so a failure names its own point):

3. an OpenAI SDK chat with an image through the Service (``kubectl port-forward``), with the
   resource's conditions (Ready, CacheCoherent) read from real pod status;
6. the containers as run: uid 1000, read-only root, no service-account token, admitted
   under ``restricted`` (a non-compliant pod is refused in the same namespace);
5. P0's SHM store in the pod's memory ``emptyDir``, read and acknowledged by P1 in the other
   container; a front-end restart leaks no segment; a volume below the store is a clear
   error and inline tensors, never a crash loop;
4. faults: the engine killed or stopped is restarted alone while the front end answers
   ``/health``; a deleted pod is replaced; ``kubectl scale`` to 2 serves from both.

Then issue 46's real-node acceptance on the same service: ``spec.encoder`` added (the operator
installed with ``encoder.enabled``), image chats through the Service are encoded on the
encoder pod, found by P0 through the headless Service's A records (the node's CoreDNS,
``scripts/realnode``); the encoder pod deleted under a loop of chats: none fails (local
fallback) and the new encoder pod serves again.

Then issue 45 item 1 on a second service of its own (``spec.frontend.apiServers: 2``): image
chats through its Service are answered by both P0 processes of its one pod (its ``/metrics``
counts them under ``api_server="0"`` and ``"1"``).

The pods' image is a 2 MB busybox (``scripts/realnode-image``); the interpreter, this
checkout with its venv and the model arrive as read-only PersistentVolumes of type
hostPath, bound to claims (a claim passes ``restricted``; a hostPath volume would not). The
manifests and helm values are ``scripts/realnode-manifests``'s, as in
``scripts/realnode-quickstart``.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import io
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import operator_kit as ok
import pytest
from kubecluster import Cluster, KubectlError
from kubecluster.process import free_port
from kubecluster.realnode import IMAGE, RealNode, missing, port_forward
from lora_adapters import LM, make_adapter  # tests/lora_adapters.py
from PIL import Image
from tools import in_ci  # tests/tools.py (on the path by conftest.py)

from mmis.tiny_models.tiny_model import build_tiny_model
from mmis_operator import encoder as encoders
from mmis_operator import kube as r

pytestmark = [pytest.mark.controlplane, pytest.mark.realnode, pytest.mark.model]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "mmis"
PSA = "pod-security.kubernetes.io"
NAME = "tiny"
STORE = 128 * 2**20  # spec.cache.size with type shm: the SHM store P0 creates
WAIT = 180.0


def _wait(what: str, check: Callable[[], Any], timeout: float = WAIT, every: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (KubectlError, httpx.HTTPError, RuntimeError, KeyError, IndexError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(every)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")


@pytest.fixture(scope="module")
def node(cluster: Cluster, crd: None) -> Iterator[RealNode]:
    reason = missing(cluster)
    if reason is not None:
        if in_ci():
            pytest.fail(f"real node unavailable with CI=true: {reason}", pytrace=False)
        pytest.skip(f"real node unavailable: {reason}")
    with RealNode(cluster) as real:
        yield real


def _manifests(*args: str) -> Any:
    """What ``scripts/realnode-manifests`` prints (this venv's interpreter: the pods run it)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "realnode-manifests"), *args],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def operator(cluster: Cluster, node: RealNode) -> Iterator[str]:
    """``helm install`` of the chart: the operator as a real pod on the real node. With no
    kube-proxy the API server is reached on the host network at 127.0.0.1."""
    ns = f"mmis-op-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    server = json.loads(cluster.kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    values = _manifests(
        "operator-values", "--apiserver-port", server.rsplit(":", 1)[1],
        "--liveness-port", str(free_port()), "--probe-seconds", "3",
    )  # fmt: skip
    values["encoder"] = {"enabled": True}  # spec.encoder (test_encoders_serve_...)
    values["adapters"] = {"enabled": True}  # spec.adapters (test_an_adapter_request_...)
    values_file = cluster.kubeconfig.parent / f"{ns}-values.json"
    values_file.write_text(json.dumps(values))
    helm = [str(cluster.bin("helm")), "install", "mmis", str(CHART), "-n", ns]
    proc = _run(cluster, *helm, "-f", str(values_file), "--wait", "--timeout", "120s")
    assert proc.returncode == 0, proc.stderr
    pods = ok.get(cluster, ns, "pods")["items"]
    assert [p["spec"]["nodeName"] for p in pods] == ["mmis-realnode"]
    yield ns
    _run(cluster, str(cluster.bin("helm")), "uninstall", "mmis", "-n", ns, "--wait")
    cluster.kubectl("delete", "namespace", ns, "--wait=false")


def _run(cluster: Cluster, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, env=cluster.env, timeout=300)


@pytest.fixture(scope="module")
def served(cluster: Cluster, operator: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The namespace (restricted) holding the tiny-model service, Ready."""
    ns = f"rn-{uuid.uuid4().hex[:6]}"
    models = tmp_path_factory.mktemp("realnode-models")
    models.chmod(0o755)  # mounted at /models: pytest makes its directories 0700
    build_tiny_model(models / "tiny-llava")  # world-readable files: the pods run as uid 1000
    docs = _manifests("service", "--namespace", ns, "--models", str(models), "--fast-liveness")
    cluster.kubectl("apply", "-f", "-", input=json.dumps(docs))
    _wait_ready(cluster, ns, 1)
    yield ns
    cluster.kubectl("delete", "namespace", ns, "--wait=false")
    for doc in docs["items"]:
        if doc["kind"] == "PersistentVolume":
            cluster.kubectl("delete", "pv", doc["metadata"]["name"], "--wait=false", check=False)


def _conditions(cluster: Cluster, ns: str) -> dict[str, dict[str, Any]]:
    status = ok.get(cluster, ns, "mmis", NAME).get("status", {})
    return {c["type"]: c for c in status.get("conditions", [])}


def _pods(cluster: Cluster, ns: str) -> list[dict[str, Any]]:
    pods = ok.get(cluster, ns, "pods", "-l", f"mmis.dev/service={NAME}")["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def _ready_pods(cluster: Cluster, ns: str) -> list[dict[str, Any]]:
    def ready(pod: dict[str, Any]) -> bool:
        conds = pod.get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

    return [p for p in _pods(cluster, ns) if ready(p)]


def _wait_ready(cluster: Cluster, ns: str, replicas: int) -> list[dict[str, Any]]:
    def check() -> list[dict[str, Any]] | None:
        pods = _ready_pods(cluster, ns)
        ready = _conditions(cluster, ns).get("Ready", {})
        if len(pods) == replicas == len(_pods(cluster, ns)) and ready.get("status") == "True":
            return pods
        return None

    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        with contextlib.suppress(KubectlError, KeyError):
            pods = check()
            if pods:
                return pods
        time.sleep(0.5)
    state = cluster.kubectl("describe", "pods,mmis,pvc", "-n", ns, check=False).stdout
    events = cluster.kubectl("get", "events", "-n", ns, check=False).stdout
    for pod in _pods(cluster, ns):
        for container in ("frontend", "engine"):
            for previous in ("--previous=false", "--previous=true"):
                logs = cluster.kubectl(
                    "logs", "-n", ns, pod["metadata"]["name"], "-c", container, previous,
                    "--tail=30", check=False,
                )  # fmt: skip
                events += f"\n--- {container} {previous}\n{logs.stdout}{logs.stderr}"
    pytest.fail(f"no {replicas} ready pod(s) and Ready=True in {WAIT:.0f}s:\n{state}\n{events}")


def _restarts(pod: dict[str, Any]) -> dict[str, int]:
    return {s["name"]: s["restartCount"] for s in pod["status"]["containerStatuses"]}


def _image_url(seed: int) -> str:
    buf = io.BytesIO()
    # distinct for every seed below 65536 (37 and 91 are odd: a bijection mod 256)
    colour = (seed * 37 % 256, seed * 91 % 256, (90 + seed // 256) % 256)
    Image.new("RGB", (64, 48), colour).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(base_url: str, seed: int) -> str:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    content: list[Any] = [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": _image_url(seed)}},
    ]
    reply = client.chat.completions.create(
        model="/models/tiny-llava",
        messages=[{"role": "user", "content": content}],
        max_tokens=6,
        temperature=0,
    )
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage is not None and reply.usage.prompt_tokens > 10  # the image's tokens
    return reply.choices[0].message.content or ""


def _pod_url(pod: dict[str, Any], port: int = 8000) -> str:
    return f"http://{pod['status']['podIP']}:{port}"


def _metric(pod: dict[str, Any], name: str) -> float:
    text = httpx.get(f"{_pod_url(pod, 8001)}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def _exec(cluster: Cluster, ns: str, pod: dict[str, Any], container: str, script: str) -> Any:
    return cluster.kubectl(
        "exec", "-n", ns, pod["metadata"]["name"], "-c", container, "--", "sh", "-c", script,
        check=False,
    )  # fmt: skip


# -- 3. the chart's operator, a resource, its pod on a real kubelet, an OpenAI chat ----------


def test_chat_through_the_service_and_conditions_from_pods(cluster: Cluster, served: str):
    (pod,) = _ready_pods(cluster, served)
    assert pod["spec"]["nodeName"] == "mmis-realnode"
    assert {s["name"]: s["ready"] for s in pod["status"]["containerStatuses"]} == {
        "frontend": True, "engine": True,
    }  # fmt: skip
    with port_forward(cluster, served, f"svc/{NAME}", 8000) as port:
        first = _chat(f"http://127.0.0.1:{port}/v1", seed=1)
        # the same photo again: a hit in P0's shadow, the evidence CacheCoherent is judged on
        assert _chat(f"http://127.0.0.1:{port}/v1", seed=1) == first

    def coherent() -> dict[str, Any]:
        conditions = _conditions(cluster, served)
        if conditions.get("CacheCoherent", {}).get("status") != "True":
            raise RuntimeError(conditions.get("CacheCoherent"))
        return conditions

    conditions = _wait("CacheCoherent from the pods' stats", coherent, timeout=60)
    assert conditions["CacheCoherent"]["reason"] == "DriftRateNormal"
    assert conditions["Ready"]["status"] == "True"
    assert "1/1 pods ready" in conditions["Ready"]["message"]


# -- 6. security as run ----------------------------------------------------------------------


def test_restricted_non_root_read_only_no_token(cluster: Cluster, served: str):
    (pod,) = _ready_pods(cluster, served)
    for container in ("frontend", "engine"):
        out = _exec(cluster, served, pod, container, "id -u; id -g; touch /probe; echo rc=$?; "
                    "ls /var/run/secrets/kubernetes.io 2>&1; ls /var/cache/mmis >/dev/null; "
                    "touch /tmp/ok && echo tmp-writable")  # fmt: skip
        lines = out.stdout.splitlines()
        assert lines[:2] == ["1000", "1000"], out
        assert "rc=1" in lines and "Read-only file system" in out.stderr, out
        assert any("No such file or directory" in line for line in lines), out  # no token
        assert "tmp-writable" in lines, out
    # the namespace enforces restricted: the same pod made privileged is refused
    bad = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "root", "namespace": served},
           "spec": {"containers": [{"name": "c", "image": IMAGE, "command": ["true"],
                                    "securityContext": {"privileged": True}}]}}  # fmt: skip
    refused = cluster.kubectl("create", "-f", "-", input=json.dumps(bad), check=False)
    assert refused.returncode != 0 and "violates PodSecurity" in refused.stderr


# -- 5. shared memory between the containers --------------------------------------------------


def test_p1_reads_what_p0_wrote_into_the_shared_volume(cluster: Cluster, served: str):
    (pod,) = _ready_pods(cluster, served)
    assert _metric(pod, "mmis_frontend_shm_capacity_bytes") >= STORE
    before = _metric(pod, "mmis_frontend_shm_reclaimed_bytes")
    _chat(f"{_pod_url(pod)}/v1", seed=2)
    # P1 acknowledges a descriptor once it read the tensors in place; P0 then reclaims them
    _wait(
        "P1's acknowledgement of the image's tensors",
        lambda: _metric(pod, "mmis_frontend_shm_reclaimed_bytes") > before,
        timeout=30,
    )
    # one tmpfs sized by the volume's sizeLimit, the writer's segment seen from the reader
    seen = _exec(cluster, served, pod, "engine", "ls /dev/shm; df -k /dev/shm | tail -1")
    assert any(line.startswith("mmis-") for line in seen.stdout.splitlines()), seen
    size_kib = int(seen.stdout.splitlines()[-1].split()[1])
    assert STORE // 1024 < size_kib <= (STORE + 1024 * 2**20) // 1024, seen.stdout


def _shm_files(cluster: Cluster, ns: str, pod: dict[str, Any]) -> set[str]:
    out = _exec(cluster, ns, pod, "engine", "ls /dev/shm").stdout.split()
    return {name for name in out if name.startswith("mmis-")}


def _kill(node: RealNode, pod: dict[str, Any], container: str, sig: signal.Signals) -> None:
    os.kill(node.container_pid(pod["metadata"]["name"], container), sig)


def _restarted(cluster: Cluster, ns: str, before: dict[str, int], name: str) -> Callable[[], Any]:
    def check() -> dict[str, Any] | None:
        pods = _ready_pods(cluster, ns)
        if len(pods) == 1 and _restarts(pods[0])[name] > before[name]:
            return pods[0]
        return None

    return check


def test_front_end_restart_leaks_no_segment(cluster: Cluster, served: str, node: RealNode):
    (pod,) = _ready_pods(cluster, served)
    before, segments = _restarts(pod), _shm_files(cluster, served, pod)
    assert segments
    _kill(node, pod, "frontend", signal.SIGKILL)
    pod = _wait("the front end restarted", _restarted(cluster, served, before, "frontend"))
    assert _restarts(pod)["engine"] == before["engine"]
    after = _shm_files(cluster, served, pod)
    assert after and not (after & segments), (segments, after)  # the dead writer's are gone
    assert len(after) == len(segments)
    assert _chat(f"{_pod_url(pod)}/v1", seed=3)


# -- 4. faults -------------------------------------------------------------------------------


def _health_during(pod: dict[str, Any], until: Callable[[], Any]) -> tuple[Any, list[int]]:
    """Poll the front end's /health until ``until()`` is truthy; the codes it answered."""
    codes: list[int] = []
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        try:
            codes.append(httpx.get(f"{_pod_url(pod)}/health", timeout=3).status_code)
        except httpx.HTTPError:
            codes.append(0)
        done = until()
        if done:
            return done, codes
        time.sleep(0.5)
    pytest.fail(f"timed out; /health answered {codes[-10:]}")


def _engine_restarted_alone(cluster: Cluster, ns: str, node: RealNode, sig: signal.Signals):
    (pod,) = _ready_pods(cluster, ns)
    before = _restarts(pod)
    _kill(node, pod, "engine", sig)
    check = _restarted(cluster, ns, before, "engine")

    def until() -> Any:
        try:
            return check()
        except (KubectlError, KeyError):
            return None

    pod, codes = _health_during(pod, until)
    assert _restarts(pod)["frontend"] == before["frontend"]
    assert codes and set(codes) == {200}, codes  # the front end answered all along
    assert _chat(f"{_pod_url(pod)}/v1", seed=4)


def test_killed_engine_is_restarted_alone(cluster: Cluster, served: str, node: RealNode):
    _engine_restarted_alone(cluster, served, node, signal.SIGKILL)


def test_deleted_pod_is_replaced_and_conditions_follow(cluster: Cluster, served: str):
    (pod,) = _ready_pods(cluster, served)
    cluster.kubectl("delete", "pod", "-n", served, pod["metadata"]["name"], "--wait=false")
    _wait(
        "Ready=False while the pod is replaced",
        lambda: _conditions(cluster, served)["Ready"]["status"] == "False",
        timeout=60,
        every=0.2,
    )
    (new,) = _wait_ready(cluster, served, 1)
    assert new["metadata"]["uid"] != pod["metadata"]["uid"]
    assert _chat(f"{_pod_url(new)}/v1", seed=5)


def test_stopped_engine_is_restarted_by_its_liveness_probe(
    cluster: Cluster, served: str, node: RealNode
):
    """After the pod was replaced: a fresh restart count, so no crash-loop back-off."""
    _engine_restarted_alone(cluster, served, node, signal.SIGSTOP)
    killing = ok.get(cluster, served, "events", "--field-selector=reason=Killing")["items"]
    assert any("engine failed liveness probe" in e["message"] for e in killing), killing


def test_scale_to_two_serves_from_both(cluster: Cluster, served: str):
    cluster.kubectl("scale", "-n", served, f"mmis/{NAME}", "--replicas=2")
    pods = _wait_ready(cluster, served, 2)
    assert "2/2 pods ready" in _conditions(cluster, served)["Ready"]["message"]
    assert len({p["status"]["podIP"] for p in pods}) == 2
    for seed, pod in enumerate(pods, start=6):
        assert _chat(f"{_pod_url(pod)}/v1", seed=seed)
    slices = ok.get(cluster, served, "endpointslices", "-l", f"kubernetes.io/service-name={NAME}")
    ready = {
        address
        for item in slices["items"]
        for ep in item.get("endpoints") or []
        if ep.get("conditions", {}).get("ready")
        for address in ep["addresses"]
    }
    assert ready == {p["status"]["podIP"] for p in pods}
    cluster.kubectl("scale", "-n", served, f"mmis/{NAME}", "--replicas=1")
    _wait_ready(cluster, served, 1)


# -- issue 46: E/PD on the real node: the encoder pod found through cluster DNS ---------------

ENCODER_REQUESTS = {"cpu": "50m", "memory": "1536Mi", "gpus": 0}  # beside the next service


def _series(url: str, name: str) -> dict[str, float]:
    """``name``'s series at ``url`` (a ``/metrics``), by their label text."""
    text = httpx.get(url, timeout=10).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, _, value = line[len(name) :].rpartition(" ")
            found[labels] = float(value)
    return found


def _count(url: str, name: str, label: str) -> float:
    """The sum of ``name``'s series whose labels hold ``label`` (e.g. ``outcome="ok"``)."""
    return sum(v for labels, v in _series(url, name).items() if label in labels)


def _encoder_pods(cluster: Cluster, ns: str) -> list[dict[str, Any]]:
    selector = ",".join(f"{k}={v}" for k, v in encoders.selector(NAME).items())
    pods = ok.get(cluster, ns, "pods", "-l", selector)["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def _ready_encoder(cluster: Cluster, ns: str, not_uids: set[str]) -> dict[str, Any] | None:
    for pod in _encoder_pods(cluster, ns):
        conds = pod.get("status", {}).get("conditions", [])
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conds)
        if ready and pod["metadata"]["uid"] not in not_uids:
            return pod
    return None


def _encoded(pod: dict[str, Any]) -> float:
    """Items the encoder pod ran through its vision tower (its own ``/metrics``)."""
    url = f"{_pod_url(pod, r.ENCODER_HEALTH_PORT)}/metrics"
    return _count(url, "mmis_encoder_items_total", 'outcome="encoded"')


def test_encoders_serve_through_cluster_dns_and_a_deleted_encoder_loses_no_request(
    cluster: Cluster, served: str
):
    """``spec.encoder`` on the real node: P0 resolves ``NAME-encoder.NS.svc`` (the headless
    Service) through the node's CoreDNS to the encoder pod's IP and has it encode; deleting
    that pod under a loop of image chats fails none of them (P0 sends the pixels meanwhile)
    and the replacement encodes again."""
    live = ok.get(cluster, served, "mmis", NAME)["spec"]
    template = live["podTemplate"]["spec"]
    (front,) = [c for c in template["containers"] if c["name"] == "frontend"]
    volumes = [v for v in template["volumes"] if "persistentVolumeClaim" in v]
    container = {"name": r.ENCODER, "env": front["env"], "volumeMounts": front["volumeMounts"]}
    spec = {
        "replicas": 1,
        "resources": ENCODER_REQUESTS,
        # the busybox image: the interpreter, checkout and model as the PD pods mount them
        "podTemplate": {"spec": {"containers": [container], "volumes": volumes}},
    }
    old = {p["metadata"]["uid"] for p in _pods(cluster, served)}
    patch = {"spec": {"encoder": spec}}
    cluster.kubectl("patch", "-n", served, f"mmis/{NAME}", "--type=merge", "-p", json.dumps(patch))
    _wait("the new PD pod", lambda: {p["metadata"]["uid"] for p in _pods(cluster, served)} - old)
    (pod,) = _wait_ready(cluster, served, 1)
    (front,) = [c for c in pod["spec"]["containers"] if c["name"] == "frontend"]
    assert front["args"][-2:] == ["--encoder-service", r.encoder_service_address(NAME, served)]
    first = _wait("the encoder pod Ready", lambda: _ready_encoder(cluster, served, set()))
    p0 = f"{_pod_url(pod, 8001)}/metrics"
    # every chat a new image: the loop below chats as fast as P0 answers for as long as the
    # encoder pod takes to come back, so a fixed supply (256 once) could run out, and a
    # repeated image is a cache hit that no encoder sees
    seeds = itertools.count(200)

    with port_forward(cluster, served, f"svc/{NAME}", 8000) as port:
        base = f"http://127.0.0.1:{port}/v1"

        def encoded_there() -> bool:
            _chat(base, next(seeds))  # P0 re-resolves the Service every 5 s: a new image a try
            return _encoded(first) > 0

        _wait("an image encoded on the encoder pod", encoded_there, timeout=60)
        asked = _count(p0, "mmis_encoder_requests_total", 'outcome="ok"')
        encoded = _encoded(first)
        fallbacks = _count(p0, "mmis_encoder_fallbacks_total", "")
        for _ in range(2):
            assert _chat(base, next(seeds))
        assert _count(p0, "mmis_encoder_requests_total", 'outcome="ok"') == asked + 2
        assert _encoded(first) == encoded + 2
        assert _count(p0, "mmis_encoder_fallbacks_total", "") == fallbacks

        # the encoder pod deleted while image chats run: each must succeed
        answered: list[int] = []
        failed: list[BaseException] = []
        stop = False

        def loop() -> None:
            while not stop:
                try:
                    _chat(base, next(seeds))
                    answered.append(1)
                except Exception as exc:  # every failure is the finding
                    failed.append(exc)

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(loop)
            try:
                cluster.kubectl(
                    "delete", "pod", "-n", served, first["metadata"]["name"], "--wait=false"
                )
                second = _wait(
                    "a new encoder pod Ready",
                    lambda: _ready_encoder(cluster, served, {first["metadata"]["uid"]}),
                    timeout=90,
                )
                # the new pod is Ready; P0 re-resolves the Service every 5 s, one chat a try:
                # 30 s ran out once in a loaded CI run (2026-12-07)
                _wait("the new encoder pod encoding", lambda: _encoded(second) > 0, timeout=60)
            finally:
                stop = True
                running.result(timeout=90)
    assert not failed, failed[:3]
    assert len(answered) >= 3, answered
    # P0 sent pixels while no encoder answered: the local fallback carried those chats
    assert _count(p0, "mmis_encoder_fallbacks_total", "") > fallbacks
    assert _restarts(_ready_pods(cluster, served)[0]) == {"frontend": 0, "engine": 0}


# -- 5. a memory volume smaller than the store ------------------------------------------------


def test_volume_below_the_store_is_a_clear_error_not_a_crash_loop(cluster: Cluster, served: str):
    small = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}}
    volumes = ok.get(cluster, served, "mmis", NAME)["spec"]["podTemplate"]["spec"]["volumes"]
    patch = {"spec": {"podTemplate": {"spec": {"volumes": [*volumes, small]}}}}  # a whole list
    old = {p["metadata"]["uid"] for p in _pods(cluster, served)}
    cluster.kubectl("patch", "-n", served, f"mmis/{NAME}", "--type=merge", "-p", json.dumps(patch))
    _wait("the new pod", lambda: {p["metadata"]["uid"] for p in _pods(cluster, served)} - old)
    (pod,) = _wait_ready(cluster, served, 1)
    assert pod["metadata"]["uid"] not in old
    assert _restarts(pod) == {"frontend": 0, "engine": 0}
    logs = cluster.kubectl("logs", "-n", served, pod["metadata"]["name"], "-c", "frontend").stderr
    logs += cluster.kubectl("logs", "-n", served, pod["metadata"]["name"], "-c", "frontend").stdout
    assert "shared-memory store not created" in logs and "--shm-gb" in logs, logs[-2000:]
    assert _metric(pod, "mmis_frontend_shm_capacity_bytes") == 0
    assert _chat(f"{_pod_url(pod)}/v1", seed=9)  # the tensors travel inline
    assert _restarts(_ready_pods(cluster, served)[0]) == {"frontend": 0, "engine": 0}


# -- issue 45: two P0 processes in one pod ------------------------------------------------------

API_SERVERS = 2
ADAPTER = "lm"  # issue 47: the LoRA adapter of the second service (spec.adapters)
# the P0 container's requests, written: exactly these for both processes (the node has 2 CPUs,
# so the unset default, 2 CPUs per process, would not fit beside the first service)
FRONTEND_REQUESTS = {"frontendCpu": "250m", "frontendMemory": "3Gi"}
_SERIES = re.compile(r"^mmis_requests_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$")


@pytest.fixture(scope="module")
def two_servers(cluster: Cluster, operator: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A namespace (restricted) holding a tiny-model service with ``apiServers: 2``, Ready."""
    ns = f"rn2-{uuid.uuid4().hex[:6]}"
    models = tmp_path_factory.mktemp("realnode-models-2")
    models.chmod(0o755)
    build_tiny_model(models / "tiny-llava")
    # issue 47: a LoRA adapter on the model volume, listed from the start (no extra rollout)
    make_adapter(models / "tiny-llava", models / ADAPTER, LM, rank=8, alpha=16, seed=1)
    for saved in (models / ADAPTER).iterdir():  # safetensors saves 0600: the pods run as 1000
        saved.chmod(0o644)
    docs = _manifests("service", "--namespace", ns, "--models", str(models))
    (resource,) = [d for d in docs["items"] if d["kind"] == "MMInferenceService"]
    resource["spec"]["frontend"] = {"apiServers": API_SERVERS}
    resource["spec"]["adapters"] = [{"name": ADAPTER, "source": f"/models/{ADAPTER}"}]
    resource["spec"]["resources"].update(FRONTEND_REQUESTS)
    cluster.kubectl("apply", "-f", "-", input=json.dumps(docs))
    _wait_ready(cluster, ns, 1)
    yield ns
    cluster.kubectl("delete", "namespace", ns, "--wait=false")
    for doc in docs["items"]:
        if doc["kind"] == "PersistentVolume":
            cluster.kubectl("delete", "pv", doc["metadata"]["name"], "--wait=false", check=False)


def _chats_by_process(pod: dict[str, Any]) -> dict[str, float]:
    """Finished 2xx chat requests of the pod's P0 processes, by ``api_server``."""
    text = httpx.get(f"{_pod_url(pod, 8001)}/metrics", timeout=10).text
    counts: dict[str, float] = {}
    for line in text.splitlines():
        found = _SERIES.match(line)
        if found is None:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', found["labels"]))
        if labels.get("endpoint") == "/v1/chat/completions" and labels.get("status") == "2xx":
            index = labels.get("api_server", "none")  # every P0 series has it with N > 1
            counts[index] = counts.get(index, 0.0) + float(found["value"])
    return counts


def test_two_api_servers_serve_image_chats_through_the_service(cluster: Cluster, two_servers: str):
    (pod,) = _ready_pods(cluster, two_servers)
    (front,) = [c for c in pod["spec"]["containers"] if c["name"] == "frontend"]
    args = front["args"]
    assert args[args.index("--api-servers") + 1] == str(API_SERVERS)
    # written requests are taken exactly (plus the /dev/shm volume on the memory)
    assert front["resources"]["requests"]["cpu"] == FRONTEND_REQUESTS["frontendCpu"]
    assert _chats_by_process(pod) == {}
    sent = 0
    with port_forward(cluster, two_servers, f"svc/{NAME}", 8000) as port:
        base = f"http://127.0.0.1:{port}/v1"
        # concurrent chats, each its own client (its own connection through the Service): the
        # processes accept on one shared socket, so a busy one leaves the next to the other
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for batch in range(6):
                seeds = range(100 + 8 * batch, 108 + 8 * batch)
                list(pool.map(lambda seed: _chat(base, seed), seeds))  # each asserts its answer
                sent += len(seeds)
                if len(_chats_by_process(pod)) == API_SERVERS:
                    break
    counts = _chats_by_process(pod)
    assert set(counts) == {str(i) for i in range(API_SERVERS)}, counts
    assert all(n > 0 for n in counts.values()) and sum(counts.values()) == sent, (counts, sent)
    assert _restarts(_ready_pods(cluster, two_servers)[0]) == {"frontend": 0, "engine": 0}


# -- issue 47: a LoRA adapter of spec.adapters served through the Service ----------------------


def test_an_adapter_request_is_served_through_the_service(cluster: Cluster, two_servers: str):
    """The chart's operator (``adapters.enabled``: its key, the token Secret it may create)
    loads the second service's adapter, a directory on the model volume, into the running pod
    through its P0s' internal routes; ``status.adapters`` names it and chats naming it are
    answered through the Service by the adapter (either P0 process may take one)."""

    seen: list[Any] = []

    def named() -> list[dict[str, Any]] | None:
        found = ok.get(cluster, two_servers, "mmis", NAME).get("status", {}).get("adapters")
        seen[:] = [found]
        return found if found and found[0]["adapters"] == [ADAPTER] else None

    try:
        (entry,) = _wait("status.adapters to name the adapter", named, timeout=60)
    except pytest.fail.Exception:
        pytest.fail(f"status.adapters never named {ADAPTER}: {seen}")
    assert (
        "error" not in entry
        and entry["pod"] == _ready_pods(cluster, two_servers)[0]["metadata"]["name"]
    )
    content: list[Any] = [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": _image_url(3)}},
    ]
    with port_forward(cluster, two_servers, f"svc/{NAME}", 8000) as port:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60
        )
        cards = {m.id: m for m in client.models.list().data}
        assert cards[ADAPTER].model_dump().get("parent") == "/models/tiny-llava"
        answers = set()
        for _ in range(4):  # a fresh connection each: either P0 process may answer
            with openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0
            ) as one:
                reply = one.chat.completions.create(
                    model=ADAPTER,
                    messages=[{"role": "user", "content": content}],
                    max_tokens=6,
                    temperature=0,
                )
            assert reply.model == ADAPTER and reply.choices[0].finish_reason in ("length", "stop")
            answers.add(reply.choices[0].message.content)
        assert len(answers) == 1  # greedy: the same adapter's answer from either process
