"""The operator's liveness endpoint as the chart renders it (issue 48 item 6): kopf's /healthz
on the pod's own IP and on a port no one picks for ``kubectl port-forward``, so a host-network
operator (scripts/realnode) never answers a user's forwarded port with a silent 404; the
probe, the container port and the NetworkPolicy name the same port."""

from __future__ import annotations

from typing import Any

import pytest
from kubecluster import Cluster
from test_chart_mmis import _docs

from mmis_operator.main import liveness_url

pytestmark = pytest.mark.controlplane

PORT_FORWARD_PICKS = {8000, 8080, 8081, 8888, 9090, 18000, 18080, 3000, 5000}


@pytest.mark.parametrize("host_network", [False, True])
def test_liveness_binds_the_pod_ip_on_an_unpicked_port(
    cluster: Cluster, host_network: bool
) -> None:
    docs = _docs(cluster, "--set", f"operator.hostNetwork={str(host_network).lower()}")
    pod: dict[str, Any] = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (endpoint,) = [a for a in container["args"] if a.startswith("--liveness-endpoint=")]
    url = endpoint.split("=", 1)[1]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert url.startswith("http://$(POD_IP):"), url  # never 0.0.0.0 nor 127.0.0.1
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    assert port not in PORT_FORWARD_PICKS
    (health,) = [p for p in container["ports"] if p["name"] == "health"]
    assert health["containerPort"] == port
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert pod.get("hostNetwork", False) is host_network
    # the kubelet expands $(POD_IP); an IPv6 pod IP gets its brackets from the operator
    expanded = url.replace("$(POD_IP)", "fd00::5")
    assert liveness_url(expanded) == f"http://[fd00::5]:{port}/healthz"
