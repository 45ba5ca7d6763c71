"""Fixtures for tests that need a real Kubernetes control plane (``tests/kube``).

Stable interface (mark such tests ``@pytest.mark.controlplane``):
  * ``cluster`` (session): ``kubecluster.Cluster`` with ``.kubeconfig: Path``,
    ``.env`` (os.environ plus KUBECONFIG and PATH with the tools bin first),
    ``.bin(name) -> Path``, ``.kubectl(*args, input=None, check=True)`` (text
    CompletedProcess), ``.restart_apiserver()``, ``.api_client()`` (kubernetes
    ApiClient), ``.kubeconfig_for_serviceaccount(namespace, name) -> Path``, ``.nodes``
    (names of the fake nodes, each with ``nvidia.com/gpu: 8``);
  * ``namespace`` (function): a fresh namespace (with its ``default`` ServiceAccount) that
    enforces Pod Security Admission ``restricted`` (the apiserver's PodSecurity plugin is on
    by default), deleted afterwards;
  * ``crd`` (session): the MMInferenceService CRD applied as a user without Helm does,
    ``kubectl apply -f crds/``, and Established
    (``kubecluster.apply_crds``; ``kubecluster.kubectl_wait`` is the retrying wait);
  * ``operator`` (function): the operator (``mmis_operator.main.OperatorThread``) watching
    ``namespace`` with ``operator_kit.options``; the test fails if it died. The kubectl helpers
    the operator tests share are in ``operator_kit.py``.

Tools come from ``$MMIS_TOOLS_DIR/bin`` (``scripts/gotools``) and etcd from
``scripts/system-deps``. When controlplane tests are selected and the Go tools are
missing, they are built once before the first test (if Go is installed). If they still
cannot be had, the tests fail with the reason when ``CI=true`` and skip otherwise.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/tools.py

import operator_kit
from kubecluster import Cluster, Tools, ToolsMissing, apply_crds, find_tools
from tools import in_ci

from mmis_operator.main import OperatorThread

PSA = "pod-security.kubernetes.io"
CRDS = Path(__file__).resolve().parents[2] / "crds"  # the source; the chart holds a copy

_tools: Tools | None = None
_tools_error: str | None = None


@pytest.hookimpl(trylast=True)  # after -m/-k deselection
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Find (or build) the tools once, outside any test's timeout, if anyone needs them."""
    global _tools, _tools_error
    if not any(item.get_closest_marker("controlplane") for item in items):
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    try:
        _tools = find_tools(build=False)
        return
    except ToolsMissing as exc:
        _tools_error = str(exc)
    log = Path(config.rootpath) / ".pytest_cache" / "gotools.log"
    log.parent.mkdir(exist_ok=True)
    if reporter is not None:
        reporter.write_line(f"control plane tools missing; running scripts/gotools (log: {log})")
    try:
        _tools = find_tools(build=True, log=log)
        _tools_error = None
    except ToolsMissing as exc:
        _tools_error = str(exc)


def _require_tools() -> Tools:
    if _tools is not None:
        return _tools
    reason = _tools_error or "control plane tools were not looked up"
    if in_ci():
        pytest.fail(f"control plane unavailable with CI=true: {reason}", pytrace=False)
    pytest.skip(f"control plane unavailable: {reason}")


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    tools = _require_tools()
    with Cluster(tools) as running:
        yield running


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:10]}"
    manifest = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": {f"{PSA}/enforce": "restricted",
                                              f"{PSA}/enforce-version": "latest"}},
    }  # fmt: skip
    cluster.kubectl("create", "-f", "-", input=json.dumps(manifest))
    cluster.kubectl(
        "wait", "--for=create", "serviceaccount/default",
        "-n", name, "--timeout=60s",
    )  # fmt: skip
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")


@pytest.fixture(scope="session")
def crd(cluster: Cluster) -> None:
    apply_crds(cluster, CRDS, "mminferenceservices.mmis.dev")


@pytest.fixture
def operator(cluster: Cluster, crd: None, namespace: str) -> Iterator[OperatorThread]:
    with OperatorThread(cluster.kubeconfig, operator_kit.options(namespace)) as running:
        yield running
    assert running.error is None, f"the operator died: {running.error!r}"
