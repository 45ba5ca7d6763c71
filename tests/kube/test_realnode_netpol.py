"""Issue 41, NetworkPolicy on a real node: a pod outside the allowed labels cannot reach the
event or operations ports.

The attacker: any pod in the cluster (a compromised workload, a tenant's job) that connects to
an inference pod's engine event sockets (5557-5560: prompts' block hashes, the replay of
everything buffered) or its front end's operations port (8001: ``/internal/*``, metrics).

The enforcer is a real CNI firewall, kube-router's network-policy controller (``scripts/realnode
up --network-policy``, built by ``scripts/gotools --netpol``; docs/REALNODE.md §9), on the real
kubelet node's bridge. The policy is the one the operator renders
(``builders.network_policy`` for a resource with ``spec.routing``, the default scrapers and an
operator peer), applied as is (minus its owner reference). The pods are busybox: a server
labelled like an inference pod (``kube.child_labels``) with a listener on every port the pod
opens (each answers ``port-N``), and clients labelled like: the picker of that resource; a
stranger; the picker of another resource; the picker's exact labels in another namespace;
a Prometheus scraper and the operator in the operator's namespace.

What each test shows, in order (one node, one set of pods):
- without the policy every client reaches every port (so a refusal later is the policy's);
- with it, only the picker reaches the event ports, the picker, scrapers and the operator
  the ops port, nobody the engine's health port, everybody the API port, and the host
  (kubelet's probes) still everything;
- the policy deleted, the stranger reaches everything again;
- ``scripts/realnode down`` leaves none of kube-router's chains or ipsets behind, and no
  chain at all that was not there before ``up`` (kubelet's ``KUBE-FIREWALL`` and
  ``KUBE-KUBELET-CANARY`` included: issue 48 item 6).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/tools.py
from kubecluster import Cluster
from kubecluster.realnode import IMAGE, IMAGE_SCRIPT, SCRIPT, RealNode, missing
from tools import in_ci, missing_tool

from mmis_operator import builders, routing
from mmis_operator import kube as r
from mmis_operator.reconciler import Security
from mmis_operator.spec import parse_spec

pytestmark = [pytest.mark.controlplane, pytest.mark.realnode, pytest.mark.security]

NAME = "tiny"
PSA = "pod-security.kubernetes.io"
HTTP, OPS, HEALTH = r.HTTP_PORT, r.OPS_PORT, r.ENGINE_HEALTH_PORT
EVENTS = (
    routing.EVENT_PORTS.kv,
    routing.EVENT_PORTS.kv_replay,
    routing.EVENT_PORTS.mm,
    routing.EVENT_PORTS.mm_replay,
)
PORTS = (HTTP, OPS, HEALTH, *EVENTS)
OPERATOR_LABELS = {"app.kubernetes.io/name": "mmis-operator"}
BRIDGE_NF = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
WAIT = 60.0

# who may reach which port once the operator's policy is applied (docs/SECURITY.md's table)
ALLOWED: dict[str, set[int]] = {
    "picker": {HTTP, OPS, *EVENTS},
    "stranger": {HTTP},
    "other-picker": {HTTP},
    "lookalike": {HTTP},  # the picker's exact labels, in another namespace
    "scraper": {HTTP, OPS},
    "operator": {HTTP, OPS},
}


def _why_not(cluster: Cluster) -> str | None:
    """Why the enforcing node cannot run here (a sentence a person can act on), or None."""
    reason = missing(cluster)
    if reason is not None:
        return reason
    if missing_tool("kube-router") is not None:
        return f"kube-router is not built ({missing_tool('kube-router')}): scripts/gotools --netpol"
    if shutil.which("ipset") is None:
        return "ipset is missing: scripts/system-deps installs it"
    if not BRIDGE_NF.exists():
        return "this kernel has no br_netfilter: bridged pod traffic bypasses iptables"
    return None


class EnforcedNode(RealNode):
    """The real node with kube-router's firewall (``scripts/realnode up --network-policy``)."""

    bridge_nf_before = ""
    chains_before: set[str] = set()

    def up(self) -> EnforcedNode:
        self._run(str(SCRIPT), "down")
        self.bridge_nf_before = BRIDGE_NF.read_text()
        self.chains_before = _chains()
        self._run(str(SCRIPT), "up", "--network-policy")
        self._run(str(IMAGE_SCRIPT))
        return self


def _chains() -> set[str]:
    """Every iptables and ip6tables chain on this host, as ``tool table chain``."""
    chains: set[str] = set()
    for tool in ("iptables-save", "ip6tables-save"):
        table = ""
        out = subprocess.run([tool], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":"):
                chains.add(f"{tool} {table} {line[1:].split()[0]}")
    return chains


def _leftovers() -> list[str]:
    """kube-router's chains, jumps and ipsets still on this host."""
    rules = subprocess.run(
        ["iptables-save", "-t", "filter"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    sets = subprocess.run(
        ["ipset", "list", "-n"], capture_output=True, text=True, check=True
    ).stdout.split()
    marks = ("KUBE-ROUTER-", "KUBE-POD-FW-", "KUBE-NWPLCY-")
    return [line for line in rules if any(m in line for m in marks)] + [
        s for s in sets if s.startswith(("KUBE-SRC-", "KUBE-DST-"))
    ]


@pytest.fixture(scope="module")
def node(cluster: Cluster) -> Iterator[EnforcedNode]:
    reason = _why_not(cluster)
    if reason is not None:
        if in_ci():
            pytest.fail(f"NetworkPolicy node unavailable with CI=true: {reason}", pytrace=False)
        pytest.skip(f"NetworkPolicy node unavailable: {reason}")
    with EnforcedNode(cluster) as real:
        yield real


def _namespace(cluster: Cluster, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    manifest = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": {f"{PSA}/enforce": "restricted"}},
    }
    cluster.kubectl("create", "-f", "-", input=json.dumps(manifest))
    return name


def _container(name: str, script: str, ports: dict[str, int]) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": name,
        "image": IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", script],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
        },
        "ports": [{"name": k, "containerPort": v, "protocol": "TCP"} for k, v in ports.items()],
    }
    if ports:  # ready once the last listener is up (the kubelet's probe: node traffic)
        container["readinessProbe"] = {
            "tcpSocket": {"port": max(ports.values())},
            "periodSeconds": 1,
        }
    return container


def _pod(ns: str, name: str, labels: dict[str, str], containers: list[dict[str, Any]]) -> Any:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {
            "nodeSelector": {"mmis.dev/realnode": "true"},
            "tolerations": [
                {"key": "mmis.dev/realnode", "operator": "Exists", "effect": "NoSchedule"}
            ],
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": r.RUN_AS_USER,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": containers,
        },
    }


def _listen(ports: dict[str, int]) -> str:
    """Every port answers ``port-N`` to each connection (busybox nc, persistent)."""
    each = " ".join(f"nc -ll -p {p} -e echo port-{p} &" for p in ports.values())
    return f"{each} wait"


class Pods:
    """The server and the clients, and a probe of every port from a client."""

    def __init__(self, cluster: Cluster, app: str, other: str, server_ip: str) -> None:
        self.cluster, self.app, self.other, self.server_ip = cluster, app, other, server_ip
        self.where = {c: app for c in ("picker", "stranger", "other-picker")}
        self.where.update({c: other for c in ("lookalike", "scraper", "operator")})

    def reach(self, client: str, ports: tuple[int, ...] = PORTS) -> dict[int, str]:
        """Each port: ``ok`` when ``client`` got that port's answer, else what nc said."""
        probe = "; ".join(
            f'echo "{p}=$(nc -w 3 {self.server_ip} {p} </dev/null 2>&1 | head -c 80)"'
            for p in ports
        )
        out = self.cluster.kubectl(
            "exec", "-n", self.where[client], client, "--", "sh", "-c", probe
        ).stdout
        seen = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        return {
            p: "ok" if seen.get(str(p), "").strip() == f"port-{p}" else seen.get(str(p), "")
            for p in ports
        }

    def reachable(self, client: str, ports: tuple[int, ...] = PORTS) -> set[int]:
        return {p for p, said in self.reach(client, ports).items() if said == "ok"}

    def reach_all(self) -> dict[str, dict[int, str]]:
        """:meth:`reach` from every client at once (a refused connect takes about a second
        here, one SYN retransmit)."""
        with ThreadPoolExecutor(len(ALLOWED)) as pool:
            return dict(zip(ALLOWED, pool.map(self.reach, ALLOWED), strict=True))


@pytest.fixture(scope="module")
def pods(cluster: Cluster, node: EnforcedNode) -> Iterator[Pods]:
    app, other = _namespace(cluster, "np-app"), _namespace(cluster, "np-other")
    frontend = {r.HTTP_PORT_NAME: HTTP, r.OPS_PORT_NAME: OPS}
    engine = {r.ENGINE_HEALTH_PORT_NAME: HEALTH}
    engine.update({p["name"]: p["containerPort"] for p in routing.engine_ports()})
    picker_labels = {**routing.picker_selector(NAME), r.LABEL_COMPONENT: "endpoint-picker"}
    sleeper = [_container("main", "exec sleep 3600", {})]
    docs = [
        _pod(app, "server", r.child_labels(NAME), [
            _container("frontend", _listen(frontend), frontend),
            _container("engine", _listen(engine), engine),
        ]),
        _pod(app, "picker", picker_labels, sleeper),
        _pod(app, "stranger", {"app": "stranger"}, sleeper),
        _pod(app, "other-picker", routing.picker_selector("other"), sleeper),
        _pod(other, "lookalike", picker_labels, sleeper),
        _pod(other, "scraper", dict(r.DEFAULT_SCRAPERS["podSelector"]["matchLabels"]), sleeper),
        _pod(other, "operator", OPERATOR_LABELS, sleeper),
    ]  # fmt: skip
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                          "items": docs}))  # fmt: skip
    try:
        for ns in (app, other):
            cluster.kubectl("wait", "-n", ns, "--for=condition=Ready", "pods", "--all",
                            f"--timeout={WAIT:.0f}s")  # fmt: skip
        server = json.loads(cluster.kubectl("get", "pod", "-n", app, "server", "-o", "json").stdout)
        yield Pods(cluster, app, other, server["status"]["podIP"])
    finally:
        for ns in (app, other):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", "--ignore-not-found")


def _policy(namespace: str, operator_namespace: str) -> dict[str, Any]:
    """What the operator renders for a resource ``NAME`` with ``spec.routing`` in ``namespace``
    (the default scrapers; the operator's pods in ``operator_namespace``)."""
    owner = {
        "apiVersion": "mmis.dev/v1alpha1",
        "kind": "MMInferenceService",
        "metadata": {"name": NAME, "namespace": namespace, "uid": str(uuid.uuid4())},
        "spec": {"model": {"id": "acme/vlm"}, "routing": {}},
    }
    security = Security(operator_namespace=operator_namespace, operator_labels=OPERATOR_LABELS)
    policy = builders.network_policy(
        owner, parse_spec(owner["spec"]), security.scrapers, security.operator_peer()
    )
    # no owner here: the garbage collector would delete a policy whose owner does not exist
    policy["metadata"].pop("ownerReferences", None)
    return policy


def _until(what: str, check: Any, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not seen within {timeout:.0f}s")
        time.sleep(0.5)


def test_without_a_policy_every_pod_reaches_every_port(pods: Pods):
    for client, said in pods.reach_all().items():
        assert said == dict.fromkeys(PORTS, "ok"), client


def test_the_operators_policy_admits_only_the_picker_to_events_and_ops(
    cluster: Cluster, pods: Pods
):
    policy = _policy(pods.app, pods.other)
    cluster.kubectl("apply", "-f", "-", input=json.dumps(policy))
    # kube-router syncs on the policy's event: wait until the stranger is refused
    _until("the stranger refused on the event port",
           lambda: EVENTS[0] not in pods.reachable("stranger", (EVENTS[0],)))  # fmt: skip
    for client, said in pods.reach_all().items():
        assert {p for p, s in said.items() if s == "ok"} == ALLOWED[client], (client, said)
    # the host (the kubelet's probes) is node traffic: always admitted
    for port in PORTS:
        with socket.create_connection((pods.server_ip, port), timeout=3) as conn:
            conn.settimeout(3)
            assert conn.recv(64).strip() == f"port-{port}".encode(), port


def test_deleting_the_policy_readmits_the_stranger(cluster: Cluster, pods: Pods):
    cluster.kubectl("delete", "networkpolicy", "-n", pods.app, NAME, "--ignore-not-found")
    _until("the stranger readmitted", lambda: pods.reachable("stranger") == set(PORTS))


def test_down_leaves_no_rule_behind(node: EnforcedNode, pods: Pods):
    assert _leftovers(), "kube-router's chains should exist while the node is up"
    node.down()
    assert _leftovers() == []
    assert _chains() - node.chains_before == set()  # kubelet's chains too (KUBE-FIREWALL, ...)
    assert BRIDGE_NF.read_text() == node.bridge_nf_before  # the sysctl restored
