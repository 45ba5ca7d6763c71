"""Replicas of ``mmis serve`` behind the real endpoint picker: the routing tests' and the
routing benchmark's stack (docs/ROUTING.md).

- N replicas of ``mmis serve`` (tiny model) on loopback addresses 127.0.0.2, .3, ..., all on
  the same serving, operations and event ports (the picker, as in a cluster, knows one port
  per role), each engine publishing its KV and multimodal events there.
- One Pod object per replica in the test control plane's API server, in ``namespace``: never
  scheduled (a scheduler name nobody runs), its status written here as a kubelet would (Running,
  Ready, ``podIP`` = the replica's address), and an ``InferencePool`` (the inference
  extension's CRD, applied from its pinned module) selecting them by label, as the operator's
  does. The picker discovers them as it discovers real pods, through its pool.
- ``mmis-epp`` (router/: GIE v1.5.0's runner with the mmis cache scorer) configured by
  ``mmis_operator.routing.picker_config`` (what the operator deploys), and ``mmis-gateway``, the
  gateway's side of its ext_proc protocol, which forwards each request where the picker says.
- One internal token per stack (docs/SECURITY.md), as the operator's Secret ``NAME-internal``
  is read in a cluster: each replica runs with ``MMIS_ENGINE_EVENTS_TOKEN`` (its event sockets
  are PLAIN servers) and ``MMIS_FRONTEND_INTERNAL_TOKEN`` (``/internal/*`` needs the bearer
  token), the picker with ``MMIS_INTERNAL_TOKEN``, so the picker reads events and block keys
  the way it does when deployed.

- :func:`epp_binary`: the picker a stack runs: ``scripts/gotools``' ``mmis-epp``, or the
  binary ``MMIS_EPP_BINARY`` names (a scratch build, e.g. with a behaviour broken on purpose
  to show that a test fails without it).

Start order (:meth:`PickerStack.start`): every replica is launched at once, none waited for
before the next (each is registered for :meth:`PickerStack.stop` the moment it exists); the
pool, the picker and the gateway come up while the replicas load; each replica's Pod is
created once that replica answers ``/ready`` (a readiness probe's view), in whatever order
they get there; the start returns once the picker sees every pod ready and the gateway answers.

Invariant: every wait is a bounded poll of an observable (an HTTP answer, a metric), never a
fixed sleep; a wait of the start fails at once, with that process's log, when any process of
the stack has exited; :meth:`PickerStack.stop` stops every process it started, even after a
failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from kubecluster import Cluster, apply_crds, inference_pool_crd
from procs import Proc
from tools import Daemon, free_port, go_tool, wait_until

from mmis.tiny_models.tiny_model import tiny_model_dir
from mmis_operator.routing import EventPorts, engine_event_args, picker_config, render

LABEL = ("app.kubernetes.io/name", "mmis-picker-test")
DESTINATION = "x-gateway-destination-endpoint"
NO_SCHEDULER = "mmis-test-no-scheduler"  # nobody schedules these pods: their status is ours
POOL = "replicas"


def _free_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


SILENCE_S = 4.0  # the tests' silenceSeconds: a stopped engine ages out within seconds
EPP_OVERRIDE = "MMIS_EPP_BINARY"


def epp_binary() -> Path:
    """``$MMIS_EPP_BINARY`` when set (it must be an executable file), else ``go_tool("mmis-epp")``
    (which fails under CI=true, or skips, when that is missing or stale)."""
    override = os.environ.get(EPP_OVERRIDE)
    if not override:
        return go_tool("mmis-epp")
    exe = Path(override)
    if not (exe.is_file() and os.access(exe, os.X_OK)):
        raise FileNotFoundError(f"{EPP_OVERRIDE}={override} is not an executable file")
    return exe


def _test_config(ops_port: int, events: EventPorts) -> dict[str, Any]:
    """What the operator deploys, with a short silence so a test need not wait 10 s."""
    return picker_config(ops_port, events, silence_seconds=SILENCE_S)


class Replica:
    """One ``mmis serve`` on its own loopback address."""

    def __init__(self, proc: Proc, ip: str, http_port: int, ops_port: int, token: str) -> None:
        self.proc, self.ip = proc, ip
        self.url = f"http://{ip}:{http_port}"
        self.ops_url = f"http://{ip}:{ops_port}"
        self._internal = {"Authorization": f"Bearer {token}"}

    def reset_prefix_cache(self) -> int:
        answer = httpx.post(
            self.ops_url + "/internal/reset_prefix_cache", headers=self._internal, timeout=30
        )
        answer.raise_for_status()
        blocks: int = answer.json()["blocks"]
        return blocks

    def metric(self, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
        """The samples ``name`` of this replica's ``/metrics`` (ops port) whose labels include
        ``labels``: (labels, value) each."""
        text = httpx.get(self.ops_url + "/metrics", timeout=10).text
        return [
            (dict(s.labels), s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == name and labels.items() <= s.labels.items()
        ]


class PickerStack:
    def __init__(
        self,
        cluster: Cluster,
        namespace: str,
        log_dir: Path,
        epp: Path,
        gateway: Path,
        *,
        replicas: int = 3,
        serve_args: tuple[str, ...] = (),
        replica_args: Mapping[int, tuple[str, ...]] | None = None,
        model: Path | None = None,
        config_for: Callable[[int, EventPorts], dict[str, Any]] | None = None,
    ) -> None:
        """``serve_args``: every replica's extra flags; ``replica_args[i]``: replica i's after
        them (an adapter on one replica only); ``model``: the served model (default: the tiny
        LLaVA); ``config_for(ops_port, events)``: the picker's configuration (default: what
        the operator deploys)."""
        self.cluster, self.namespace, self.log_dir = cluster, namespace, log_dir
        self._epp_exe, self._gateway_exe = epp, gateway
        self.n, self._serve_args = replicas, serve_args
        self._replica_args = dict(replica_args or {})
        p = _free_ports(10)
        self.http_port, self.ops_port = p[0], p[1]
        self.events = EventPorts(kv=p[2], kv_replay=p[3], mm=p[4], mm_replay=p[5])
        self.grpc_port, self.health_port, self.metrics_port, self.gateway_port = p[6:10]
        self.model = model or tiny_model_dir()
        self.config = (config_for or _test_config)(self.ops_port, self.events)
        self.token = secrets.token_hex(32)  # the shape of the operator's Secret
        self.replicas: list[Replica] = []
        self._daemons: list[Daemon] = []
        self.url = f"http://127.0.0.1:{self.gateway_port}"

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> PickerStack:
        try:
            for i in range(self.n):
                self._start_replica(f"127.0.0.{i + 2}", i)
            self._create_pool()
            self._start_picker()
            self._await_replicas(timeout=300)
            self._await_picker()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for d in reversed(self._daemons):
            with contextlib.suppress(Exception):
                d.stop(timeout=20)

    def __enter__(self) -> PickerStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start_replica(self, ip: str, i: int) -> None:
        log_dir = self.log_dir / f"replica-{i}"
        log_dir.mkdir(parents=True, exist_ok=True)
        args = ["serve", "--model", str(self.model), "--served-model-name", "tiny"]
        args += ["--host", ip, "--port", str(self.http_port), "--ops-port", str(self.ops_port)]
        args += [*engine_event_args(self.events, host=ip), *self._serve_args]
        args += self._replica_args.get(i, ())
        env = {"MMIS_ENGINE_EVENTS_TOKEN": self.token, "MMIS_FRONTEND_INTERNAL_TOKEN": self.token}
        # launched, not waited for: its stdout goes to its log (its "listening" line unread),
        # its address is known, and its /ready is polled with the others' (_await_replicas)
        proc = Proc(f"serve-{i}", args, log_dir, env=env)
        self._daemons.append(proc)
        replica = Replica(proc, ip, self.http_port, self.ops_port, self.token)
        proc.root_url = replica.url
        self.replicas.append(replica)

    def _exited(self, waiting_for: str) -> None:
        """``RuntimeError`` with its log's tail when a process of the stack has exited."""
        for d in self._daemons:
            if d.popen.poll() is not None:
                raise RuntimeError(
                    f"{d.name} exited (rc {d.popen.returncode}) while waiting for {waiting_for}"
                    f"\n{d.log_tail()}"
                )

    def _await_replicas(self, timeout: float) -> None:
        """Poll every replica's ``/ready`` together; each one's Pod is created as it answers."""
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self.replicas))
        while pending:
            self._exited("the replicas' /ready")
            for i, r in list(pending.items()):
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(r.url + "/ready", timeout=5).status_code == 200:
                        self._create_pod(r, i)
                        del pending[i]
            if not pending:
                return
            if time.monotonic() > deadline:
                tails = "\n".join(f"{r.proc.name}:\n{r.proc.log_tail()}" for r in pending.values())
                raise TimeoutError(f"replicas not ready within {timeout:.0f}s\n{tails}")
            time.sleep(0.1)  # polling other processes' APIs; not a synchronisation

    def _create_pod(self, r: Replica, i: int) -> None:
        name = f"replica-{i}"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": self.namespace, "labels": dict([LABEL])},
            "spec": {
                "schedulerName": NO_SCHEDULER,
                "securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                                    "seccompProfile": {"type": "RuntimeDefault"}},
                "containers": [{
                    "name": "serve", "image": "mmis:test",
                    "ports": [{"containerPort": self.http_port}],
                    "securityContext": {"allowPrivilegeEscalation": False,
                                        "capabilities": {"drop": ["ALL"]}},
                }],
            },
        }  # fmt: skip
        self.cluster.kubectl("create", "-f", "-", input=json.dumps(pod))
        status = {
            "status": {
                "phase": "Running",
                "podIP": r.ip,
                "podIPs": [{"ip": r.ip}],
                "conditions": [{"type": "Ready", "status": "True"}],
            }
        }
        self.cluster.kubectl(
            "patch", "pod", name, "-n", self.namespace, "--subresource=status",
            "--type=merge", "-p", json.dumps(status),
        )  # fmt: skip

    def _create_pool(self) -> None:
        apply_crds(self.cluster, inference_pool_crd(), "inferencepools.inference.networking.k8s.io")
        pool = {
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": POOL, "namespace": self.namespace},
            "spec": {
                "selector": {"matchLabels": dict([LABEL])},
                "targetPorts": [{"number": self.http_port}],
                "endpointPickerRef": {"name": "mmis-epp", "port": {"number": self.grpc_port}},
            },
        }
        self.cluster.kubectl("create", "-f", "-", input=json.dumps(pool))

    def _start_picker(self) -> None:
        epp = Daemon(
            "mmis-epp",
            [
                str(self._epp_exe),
                f"--pool-name={POOL}",
                f"--pool-namespace={self.namespace}",
                f"--model-server-metrics-port={self.ops_port}",
                f"--grpc-port={self.grpc_port}",
                f"--grpc-health-port={self.health_port}",
                f"--metrics-port={self.metrics_port}",
                "--secure-serving=false",
                "--tracing=false",
                "--metrics-endpoint-auth=false",
                f"--config-text={render(self.config)}",
                "--v=2",
            ],
            self.log_dir,
            # in --endpoint-selector mode the picker names its pool after its own pod
            env={
                "KUBECONFIG": str(self.cluster.kubeconfig),
                "POD_NAME": "mmis-epp-test",
                "POD_NAMESPACE": self.namespace,
                "MMIS_INTERNAL_TOKEN": self.token,
            },
        )
        self._daemons.append(epp)
        self.epp = epp
        # its gRPC client connects lazily: it may start before the picker listens
        gw = Daemon(
            "mmis-gateway",
            [str(self._gateway_exe), f"--listen=127.0.0.1:{self.gateway_port}",
             f"--picker=127.0.0.1:{self.grpc_port}"],
            self.log_dir,
        )  # fmt: skip
        self._daemons.append(gw)
        self.gateway = gw

    def _await_picker(self) -> None:
        """The picker sees every pod ready, then the gateway answers."""

        def all_ready() -> bool:
            self._exited("the picker")
            return self.picker_metric("inference_pool_ready_pods") == self.n

        def models() -> bool:
            self._exited("the gateway")
            return httpx.get(self.url + "/v1/models", timeout=5).status_code < 500

        wait_until(f"the picker sees {self.n} ready pods", all_ready, 120, self.epp)
        wait_until("the gateway answers", models, 60, self.gateway)

    # ----------------------------------------------------------------- use
    def chat(self, body: dict[str, Any], timeout: float = 120) -> tuple[str, dict[str, Any]]:
        """POST a chat through the gateway: (the replica address it went to, the answer)."""
        answer = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=timeout)
        if answer.status_code != 200:
            raise AssertionError(f"{answer.status_code}: {answer.text[:500]}")
        dest = answer.headers.get(DESTINATION, "")
        return dest.rsplit(":", 1)[0], answer.json()

    def picker_metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text

    def picker_metric(self, name: str, **labels: str) -> float | None:
        """The value of one series of the picker's metrics (labels must match exactly those
        given, in any order), or None when absent."""
        for line in self.picker_metrics().splitlines():
            m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})?\s+(\S+)$", line)
            if m is None:
                continue
            have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                return float(m.group(2))
        return None

    def wait_metric(
        self,
        what: str,
        name: str,
        ok: Callable[[float | None], bool],
        timeout: float = 30,
        **labels: str,
    ) -> float | None:
        """Poll a picker metric until ``ok(value)``; its last value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.picker_metric(name, **labels)
            if ok(value):
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: {name}{labels} = {value}\n{self.epp.log_tail()}")
            time.sleep(0.05)  # polling the picker's metrics endpoint; not a synchronisation
