"""Command lines of etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok.

Invariants:
  * everything binds 127.0.0.1 on ports chosen by the caller (free ports), never a
    well-known port, so several clusters (and a system etcd) can coexist;
  * the apiserver enforces RBAC (``--authorization-mode=RBAC``); only the admin client
    cert (``system:masters``) and the controllers' own service accounts get through;
  * the controller manager runs the node-lifecycle controller, which lifts the not-ready
    taint that the NodeTaint admission plugin puts on every new Node (without it no pod
    ever schedules on the kwok nodes);
  * kwok's pod CIDR (10.244.0.0/16) is disjoint from the service range (10.96.0.0/16).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .pki import PKI
from .tools import Tools

SERVICE_CIDR = "10.96.0.0/16"
FIRST_SERVICE_IP = "10.96.0.1"
POD_CIDR = "10.244.0.0/16"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    kwok: int


def etcd_argv(tools: Tools, data_dir: Path, ports: Ports) -> list[str]:
    client = f"http://127.0.0.1:{ports.etcd_client}"
    peer = f"http://127.0.0.1:{ports.etcd_peer}"
    return [
        str(tools.etcd),
        "--name=default",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=default={peer}",
        "--initial-cluster-state=new",
        "--unsafe-no-fsync",
        "--log-level=warn",
    ]


def apiserver_argv(tools: Tools, pki: PKI, ports: Ports) -> list[str]:
    return [
        str(tools.path("kube-apiserver")),
        f"--etcd-servers=http://127.0.0.1:{ports.etcd_client}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--secure-port={ports.apiserver}",
        f"--tls-cert-file={pki.serving_cert}",
        f"--tls-private-key-file={pki.serving_key}",
        f"--client-ca-file={pki.ca_cert}",
        f"--service-account-issuer={SA_ISSUER}",
        f"--service-account-key-file={pki.sa_pub}",
        f"--service-account-signing-key-file={pki.sa_key}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--authorization-mode=RBAC",
        "--allow-privileged=true",
        # reach a real kubelet (logs, exec) at its InternalIP, not its unresolvable hostname
        "--kubelet-preferred-address-types=InternalIP,Hostname",
        # Debian's etcd 3.4 cannot answer watch progress requests, which a streamed list
        # (WatchList, beta and on by default) needs: with it on, every client's watches
        # ended in errors and were re-listed only every ~20-60 s (kwok acted that late).
        # Off, clients fall back to plain LIST + WATCH at once.
        "--feature-gates=WatchList=false",
        "--profiling=false",
        "--v=1",
    ]


def _kube_common(kubeconfig: Path, port: int) -> list[str]:
    return [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--leader-elect=false",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        "--v=1",
    ]


def controller_manager_argv(tools: Tools, pki: PKI, ports: Ports, kubeconfig: Path) -> list[str]:
    return [
        str(tools.path("kube-controller-manager")),
        *_kube_common(kubeconfig, ports.controller_manager),
        "--controllers=*",
        "--use-service-account-credentials=true",
        f"--service-account-private-key-file={pki.sa_key}",
        f"--root-ca-file={pki.ca_cert}",
        f"--cluster-signing-cert-file={pki.ca_cert}",
        f"--cluster-signing-key-file={pki.ca_key}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        f"--cluster-cidr={POD_CIDR}",
        "--allocate-node-cidrs=false",
        "--node-monitor-period=1s",
        "--concurrent-deployment-syncs=10",
    ]


def scheduler_argv(tools: Tools, ports: Ports, kubeconfig: Path) -> list[str]:
    return [str(tools.path("kube-scheduler")), *_kube_common(kubeconfig, ports.scheduler)]


def kwok_argv(tools: Tools, ports: Ports, kubeconfig: Path) -> list[str]:
    return [
        str(tools.path("kwok")),
        f"--kubeconfig={kubeconfig}",
        # only the fake nodes (cluster.node_manifest annotates them): a real kubelet's node
        # (scripts/realnode) must not get kwok's heartbeats, lease or pod statuses
        "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
        f"--cidr={POD_CIDR}",
        "--node-ip=10.240.0.1",
        f"--server-address=127.0.0.1:{ports.kwok}",
        # renew node Leases (every ~10 s): without them the node lifecycle controller sees
        # only kwok's sparse status heartbeats (~50 s apart under load), marks the nodes
        # unhealthy and sets every pod Ready=False, which kwok never sets back
        "--node-lease-duration-seconds=40",
    ]
