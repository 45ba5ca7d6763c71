"""A real Kubernetes control plane on loopback: etcd, apiserver, controller manager,
scheduler and kwok (fake nodes that run pods), no Docker and no kubelet.

Invariants:
  * ``start`` returns only when the apiserver is ready, every component is healthy, the
    fake nodes are Ready without taints and the ``default`` ServiceAccount exists, so a
    Deployment created right after it gets Running pods;
  * ``stop`` (also on a failed ``start``) stops every process group, and removes the work
    directory when the cluster created it; calling it twice is harmless;
  * the admin kubeconfig (``system:masters``) is ``kubeconfig``; other identities come
    from ``kubeconfig_for_serviceaccount`` and are subject to RBAC;
  * ``restart_apiserver`` keeps the port, certs and etcd, so existing clients reconnect.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import components as c
from .api import AdminApi, ApiError, plain_http_ok, plain_https_ok, write_kubeconfig
from .pki import make_pki
from .process import Component, ComponentError, free_port
from .tools import Tools

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

GPUS_PER_NODE = 8
_NOT_READY_TAINT = "node.kubernetes.io/not-ready"
_WORKDIR_PREFIX = "mmis-kube-"
_START_ATTEMPTS = 3


class KubectlError(subprocess.CalledProcessError):
    """A failed ``Cluster.kubectl`` call; unlike its base class, ``str()`` shows stderr."""

    def __str__(self) -> str:
        args = " ".join(str(a) for a in self.cmd[2:])
        return f"kubectl {args} exited with {self.returncode}: {(self.stderr or '').strip()}"


def _reap_stale_workdirs() -> None:
    """Remove work dirs left by killed runs (their processes died with them: PDEATHSIG)."""
    for stale in Path(tempfile.gettempdir()).glob(f"{_WORKDIR_PREFIX}*"):
        try:
            os.kill(int((stale / "owner.pid").read_text()), 0)
        except ProcessLookupError:
            shutil.rmtree(stale, ignore_errors=True)
        except (OSError, ValueError):
            continue  # no owner file yet, or not ours to judge


def node_manifest(name: str) -> dict[str, Any]:
    capacity = {
        "cpu": "32",
        "memory": "256Gi",
        "pods": "110",
        "nvidia.com/gpu": str(GPUS_PER_NODE),
        "ephemeral-storage": "20Ti",  # 110 pods with the default 50Gi model cache emptyDir
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
            },
            "annotations": {"node.alpha.kubernetes.io/ttl": "0", "kwok.x-k8s.io/node": "fake"},
        },
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
            "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux"},
        },
    }


class Cluster:
    def __init__(
        self, tools: Tools, workdir: Path | None = None, nodes: int = 2, timeout: float = 180.0
    ) -> None:
        self.tools = tools
        self._owns_workdir = workdir is None
        if workdir is None:
            _reap_stale_workdirs()
            workdir = Path(tempfile.mkdtemp(prefix=_WORKDIR_PREFIX))
            (workdir / "owner.pid").write_text(f"{os.getpid()}\n")
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.timeout = timeout
        self.nodes = [f"kwok-node-{i}" for i in range(nodes)]
        self.kubeconfig = self.workdir / "admin.kubeconfig"
        self._pick_ports()
        self.env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": f"{tools.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        self._components: list[Component] = []
        self._api: AdminApi | None = None

    # -- lifecycle -----------------------------------------------------------------
    def _pick_ports(self) -> None:
        self.ports = c.Ports(*(free_port() for _ in range(6)))
        self.server = f"https://127.0.0.1:{self.ports.apiserver}"

    def start(self) -> None:
        """Start everything; a port taken between picking and binding means a retry on
        fresh ports (other test runs share the machine), anything else is raised."""
        for attempt in range(_START_ATTEMPTS):
            try:
                self._start()
                return
            except ComponentError as exc:
                self._stop_components()
                if "address already in use" not in str(exc) or attempt + 1 == _START_ATTEMPTS:
                    self.stop()
                    raise
                shutil.rmtree(self.workdir / "etcd", ignore_errors=True)
                self._pick_ports()
            except BaseException:
                self.stop()
                raise

    def _component(
        self, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> Component:
        comp = Component(name, argv, self.workdir / "logs", env)
        self._components.append(comp)
        comp.start()
        return comp

    def _start(self) -> None:
        pki = make_pki(self.workdir / "pki", c.FIRST_SERVICE_IP)
        self.pki = pki
        self._api = AdminApi(self.server, pki.ca_cert, pki.admin_cert, pki.admin_key)
        user = {"client-certificate": str(pki.admin_cert), "client-key": str(pki.admin_key)}
        write_kubeconfig(self.kubeconfig, self.server, pki.ca_cert, user)

        etcd_url = f"http://127.0.0.1:{self.ports.etcd_client}/health"
        etcd = self._component("etcd", c.etcd_argv(self.tools, self.workdir / "etcd", self.ports))
        etcd.wait_until(lambda: plain_http_ok(etcd_url), self.timeout, "healthy")
        self._apiserver = self._component(
            "kube-apiserver", c.apiserver_argv(self.tools, pki, self.ports)
        )
        self._apiserver.wait_until(self._api.healthy, self.timeout, "ready")

        kcm = self._component(
            "kube-controller-manager",
            c.controller_manager_argv(self.tools, pki, self.ports, self.kubeconfig),
        )
        sched = self._component(
            "kube-scheduler", c.scheduler_argv(self.tools, self.ports, self.kubeconfig)
        )
        kwok_home = self.workdir / "kwok-home"  # keeps a user's ~/.kwok/kwok.yaml out
        kwok_home.mkdir(exist_ok=True)
        kwok = self._component(
            "kwok",
            c.kwok_argv(self.tools, self.ports, self.kubeconfig),
            {**os.environ, "HOME": str(kwok_home)},
        )
        for comp, port in ((kcm, self.ports.controller_manager), (sched, self.ports.scheduler)):
            url = f"https://127.0.0.1:{port}/healthz"
            comp.wait_until(partial(plain_https_ok, url), self.timeout, "healthy")

        for name in self.nodes:
            self._api.post("/api/v1/nodes", node_manifest(name))
        kwok.wait_until(
            self._nodes_schedulable, self.timeout, "getting the nodes Ready and untainted"
        )
        kcm.wait_until(
            lambda: self._exists("/api/v1/namespaces/default/serviceaccounts/default"),
            self.timeout,
            "creating the default ServiceAccount",
        )

    def _stop_components(self) -> None:
        for comp in reversed(self._components):
            comp.stop()
        self._components.clear()

    def stop(self) -> None:
        self._stop_components()
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- health --------------------------------------------------------------------
    def _exists(self, path: str) -> bool:
        if self._api is None:
            return False
        try:
            self._api.get(path)
        except ApiError:
            return False
        return True

    def _nodes_schedulable(self) -> bool:
        if self._api is None:
            return False
        try:
            items = self._api.get("/api/v1/nodes")["items"]
        except ApiError:
            return False
        ready = set()
        for node in items:
            conditions = node.get("status", {}).get("conditions") or []
            taints = node.get("spec", {}).get("taints") or []
            is_ready = any(x["type"] == "Ready" and x["status"] == "True" for x in conditions)
            if is_ready and not any(t["key"] == _NOT_READY_TAINT for t in taints):
                ready.add(node["metadata"]["name"])
        return ready >= set(self.nodes)

    def alive(self) -> dict[str, bool]:
        return {comp.name: comp.running() for comp in self._components}

    def pids(self) -> dict[str, int]:
        return {comp.name: comp.pid for comp in self._components if comp.pid is not None}

    # -- the fixture interface -------------------------------------------------------
    def bin(self, name: str) -> Path:
        return self.tools.path(name)

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 120,
        kubeconfig: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl as admin (or as ``kubeconfig``'s identity); text output captured."""
        cmd = [str(self.bin("kubectl")), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args]
        proc = subprocess.run(
            cmd, input=input, capture_output=True, text=True, env=self.env, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise KubectlError(proc.returncode, cmd, proc.stdout, proc.stderr)
        return proc

    def restart_apiserver(self) -> None:
        """Stop kube-apiserver and start it again on the same port; wait until ready."""
        if self._api is None:
            raise RuntimeError("the cluster is not started")
        self._apiserver.stop()
        self._apiserver.start()
        self._apiserver.wait_until(self._api.healthy, self.timeout, "ready after restart")

    def api_client(self) -> ApiClient:
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def kubeconfig_for_serviceaccount(self, namespace: str, name: str) -> Path:
        """A kubeconfig acting as ServiceAccount ``namespace/name`` (created if absent),
        authenticated by a token from the TokenRequest API; RBAC applies to it."""
        if self.kubectl("get", "serviceaccount", name, "-n", namespace, check=False).returncode:
            self.kubectl("create", "serviceaccount", name, "-n", namespace)
        token = self.kubectl("create", "token", name, "-n", namespace, "--duration=24h").stdout
        path = self.workdir / f"sa-{namespace}-{name}.kubeconfig"
        return write_kubeconfig(path, self.server, self.pki.ca_cert, {"token": token.strip()})
