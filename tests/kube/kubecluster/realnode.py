"""A real kubelet node joined to a test :class:`Cluster` (``scripts/realnode``, docs/REALNODE.md).

The node runs real containers (containerd + runc, CNI bridge ``10.245.0.0/24``); it is
registered tainted ``mmis.dev/realnode=true:NoSchedule`` and labelled
``mmis.dev/realnode=true``, so only pods that ask for it land there (the manifests of
``scripts/realnode-manifests``).
Pod IPs are reachable from this host; Service IPs are not (no kube-proxy): tests reach a
Service through ``kubectl port-forward`` (:func:`port_forward`) or pods at their IPs.

Invariants: one node per machine (``scripts/realnode`` owns the bridge and kubelet's port);
:meth:`RealNode.down` leaves no process, mount or bridge behind and is safe to call twice.
Stdlib only, like the rest of ``kubecluster``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from .cluster import Cluster

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "realnode"
IMAGE_SCRIPT = ROOT / "scripts" / "realnode-image"
NAME = "mmis-realnode"
IMAGE = "mmis.local/busybox:1.35.0"  # scripts/realnode-image
PACKAGES = "containerd runc containernetworking-plugins busybox-static"


def missing(cluster: Cluster) -> str | None:
    """Why a real node cannot run here (a sentence a person can act on), or None."""
    if os.geteuid() != 0:
        return "the real node needs root (kubelet and containerd)"
    for exe in ("containerd", "runc", "ctr"):
        if shutil.which(exe) is None:
            return f"{exe} is missing: scripts/system-deps installs {PACKAGES}"
    if not Path("/usr/lib/cni/bridge").exists():
        return f"the CNI plugins are missing: scripts/system-deps installs {PACKAGES}"
    bin_dir = cluster.bin("kubectl").parent
    for tool in ("kubelet", "crictl", "coredns"):  # coredns: the node's cluster DNS
        if not (bin_dir / tool).exists():
            return f"{tool} is not built: run scripts/gotools --realnode"
    return None


class RealNode:
    """``scripts/realnode up`` on ``cluster`` (returns once the Node is Ready) plus the
    offline images; :meth:`down` stops it."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.env = {**cluster.env, "KUBECONFIG": str(cluster.kubeconfig)}
        self.socket = Path(
            os.environ.get("MMIS_REALNODE_DIR", Path.home() / ".cache/mmis/realnode")
        ) / "containerd" / "containerd.sock"  # fmt: skip

    def _run(self, *argv: str, timeout: float = 180) -> str:
        proc = subprocess.run(
            argv, capture_output=True, text=True, env=self.env, timeout=timeout, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc.stdout

    def up(self) -> RealNode:
        self._run(str(SCRIPT), "down")  # a node left by a killed session belongs to another plane
        self._run(str(SCRIPT), "up")
        self._run(str(IMAGE_SCRIPT))
        return self

    def down(self) -> None:
        self._run(str(SCRIPT), "down")

    def __enter__(self) -> RealNode:
        return self.up()

    def __exit__(self, *_: object) -> None:
        self.down()

    def crictl(self, *args: str) -> str:
        return self._run(
            str(self.cluster.bin("crictl")),
            f"--runtime-endpoint=unix://{self.socket}",
            *args,
            timeout=30,
        ).strip()

    def container_pid(self, pod: str, container: str) -> int:
        """The host PID of ``container``'s main process in ``pod`` (the running attempt)."""
        ids = self.crictl("ps", "--pod", self._pod_id(pod), "--name", f"^{container}$", "-q")
        if not ids:
            raise RuntimeError(f"no running container {container!r} in pod {pod!r}")
        template = "{{.info.pid}}"
        return int(self.crictl("inspect", "-o", "go-template", "--template", template, ids[:13]))

    def _pod_id(self, pod: str) -> str:
        ids = self.crictl("pods", "--name", f"^{pod}$", "--state", "ready", "-q").split()
        if len(ids) != 1:
            raise RuntimeError(f"pod {pod!r}: {len(ids)} running sandboxes")
        return ids[0]


@contextlib.contextmanager
def port_forward(cluster: Cluster, namespace: str, target: str, port: int) -> Iterator[int]:
    """``kubectl port-forward`` to ``target`` (e.g. ``svc/NAME``): yields the local port."""
    proc = subprocess.Popen(
        [str(cluster.bin("kubectl")), f"--kubeconfig={cluster.kubeconfig}", "-n", namespace,
         "port-forward", target, f":{port}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cluster.env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 30
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            found = re.search(r"Forwarding from 127\.0\.0\.1:(\d+)", line)
            if found:
                yield int(found.group(1))
                return
            if not line and proc.poll() is not None:
                break
        raise RuntimeError(f"kubectl port-forward {target} did not start: {line!r}")
    finally:
        proc.terminate()
        proc.wait(10)
