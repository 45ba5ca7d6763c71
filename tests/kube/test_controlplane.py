"""Smoke tests of the test control plane itself (the ``cluster`` fixture and launcher)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import pytest
from kubecluster import GPUS_PER_NODE, Cluster, find_tools, kubectl_wait

pytestmark = pytest.mark.controlplane

KUBE_VERSION = "v1.36.3"  # the pin in scripts/gotools


def _deployment(name: str, replicas: int, gpus: int) -> str:
    container = {
        "name": "main",
        "image": "example.invalid/fake:1",
        "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
        # the test namespaces enforce Pod Security "restricted" (conftest.namespace)
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    return json.dumps(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": {"app": name}},
                "template": {
                    "metadata": {"labels": {"app": name}},
                    "spec": {"containers": [container]},
                },
            },
        }
    )


def _pods(cluster: Cluster, namespace: str, app: str) -> list[dict]:
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", f"app={app}", "-o", "json")
    return json.loads(out.stdout)["items"]


def test_server_reports_the_pinned_version(cluster: Cluster) -> None:
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == KUBE_VERSION
    assert version["clientVersion"]["gitVersion"] == KUBE_VERSION
    helm = subprocess.run(
        [str(cluster.bin("helm")), "version", "--short"],
        capture_output=True, text=True, env=cluster.env, check=True,
    )  # fmt: skip
    assert helm.stdout.startswith("v3.")


def test_nodes_advertise_gpus(cluster: Cluster) -> None:
    nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == sorted(cluster.nodes)
    for node in nodes:
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == str(GPUS_PER_NODE)
        assert not node["spec"].get("taints")


def test_deployment_pods_run_on_kwok_nodes(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=_deployment("web", 3, gpus=2))
    cluster.kubectl("rollout", "status", "deployment/web", "-n", namespace, "--timeout=120s")
    pods = _pods(cluster, namespace, "web")
    assert len(pods) == 3
    for pod in pods:
        assert pod["status"]["phase"] == "Running"
        assert pod["spec"]["nodeName"] in cluster.nodes


def test_gpu_requests_beyond_capacity_stay_pending(cluster: Cluster, namespace: str) -> None:
    too_many = GPUS_PER_NODE + 1
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=_deployment("big", 1, too_many))
    waited = kubectl_wait(
        cluster, "pod", "-l", "app=big", "-n", namespace,
        "--for=jsonpath={.status.conditions[?(@.type=='PodScheduled')].reason}=Unschedulable",
        timeout_s=120,
    )  # fmt: skip
    assert waited.returncode == 0, waited.stderr
    (pod,) = _pods(cluster, namespace, "big")
    assert pod["status"]["phase"] == "Pending"
    assert "nodeName" not in pod["spec"]


def test_rbac_denies_a_serviceaccount_without_permissions(cluster: Cluster, namespace: str) -> None:
    as_sa = cluster.kubeconfig_for_serviceaccount(namespace, "nobody")
    denied = cluster.kubectl("get", "pods", "-n", namespace, kubeconfig=as_sa, check=False)
    assert denied.returncode != 0
    assert "forbidden" in denied.stderr.lower()
    assert f"system:serviceaccount:{namespace}:nobody" in denied.stderr

    # the same identity is allowed once RBAC grants it: the denial was authorisation,
    # not a broken token
    cluster.kubectl("create", "role", "pod-reader", "--verb=get,list", "--resource=pods",
                    "-n", namespace)  # fmt: skip
    cluster.kubectl("create", "rolebinding", "nobody-reads", "--role=pod-reader",
                    f"--serviceaccount={namespace}:nobody", "-n", namespace)  # fmt: skip
    deadline = time.monotonic() + 30
    while True:  # RBAC caches update asynchronously; poll the real authorizer
        allowed = cluster.kubectl("get", "pods", "-n", namespace, kubeconfig=as_sa, check=False)
        if allowed.returncode == 0 or time.monotonic() > deadline:
            break
    assert allowed.returncode == 0, allowed.stderr
    assert cluster.kubectl(
        "auth", "can-i", "delete", "pods", "-n", namespace, kubeconfig=as_sa, check=False
    ).stdout.strip() == "no"  # fmt: skip


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_port_clash_retries_and_stop_leaves_nothing(cluster: Cluster) -> None:
    # a second, private cluster (the session one stays up); `cluster` only ensures tools
    second = Cluster(find_tools(), nodes=1)
    taken = second.ports.apiserver
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", taken))  # someone grabs the port before the apiserver
        squatter.listen()
        second.start()
    try:
        assert second.ports.apiserver != taken
        assert second.kubectl("get", "nodes", "-o", "name").stdout.split() == [
            f"node/{second.nodes[0]}"
        ]
        pids = second.pids()
        ports = list(vars(second.ports).values())
        workdir = second.workdir
        assert set(pids) == {"etcd", "kube-apiserver", "kube-controller-manager",
                             "kube-scheduler", "kwok"}  # fmt: skip
        assert _port_in_use(second.ports.apiserver)
    finally:
        second.stop()

    for name, pid in pids.items():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
            pytest.fail(f"{name} (pid {pid}) still running")
    assert [p for p in ports if _port_in_use(p)] == []
    assert not workdir.exists()
