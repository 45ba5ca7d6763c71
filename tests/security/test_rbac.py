"""Issue 41, item 6 (least privilege): the RBAC the chart renders, read rule by rule.

What an attacker did: took over the operator's ServiceAccount (its token is mounted in its
pod) and found, in the default cluster-wide install, create/patch/delete on configmaps,
serviceaccounts, roles and rolebindings in every namespace plus lease rights: enough to patch
``kube-system`` ConfigMaps, or write itself a Role granting anything it held and bind it.
The rights were there only so the operator could grant the picker its Role (Kubernetes lets
a subject grant only what it holds).

Now the chart ships the picker's ClusterRole and the operator may only ``bind`` it, by name;
every routing right is behind ``routing.enabled``. Checked on ``helm template`` for the
default values, ``routing.enabled=true``, ``watchNamespaces`` set (with and without routing)
and peering, failing on:

- any verb on Secrets but ``create``;
- any verb on roles, clusterroles or clusterrolebindings, except ``bind`` on clusterroles
  limited by ``resourceNames`` to the picker's ClusterRole;
- ``escalate``, ``impersonate``, or a ``*`` anywhere;
- configmaps writes;
- a Role or RoleBinding in ``kube-system`` (and ``watchNamespaces`` naming it is refused);
- with ``routing.enabled=false``, any verb on secrets, rolebindings or serviceaccounts.

The checker is shown to fail on the chart as it was before this fix (rendered from git, when
the history is there) and on one rule of each forbidden kind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/tools.py
from tools import in_ci

from mmis_operator import routing

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "mmis"
RELEASE_NS = "mmis-system"
PICKER_ROLE = "rel-mmis-operator-picker"  # <fullname>-picker for release "rel"
BEFORE_FIX = "2e42b9c"  # the chart as issue 41 found it
RBAC = "rbac.authorization.k8s.io"
WRITES = {"create", "update", "patch", "delete", "deletecollection"}
VALUE_SETS: dict[str, tuple[list[str], bool]] = {  # name -> (helm values, routing enabled)
    "defaults": ([], False),
    "routing": (["--set", "routing.enabled=true"], True),
    "namespaced": (["--set", "operator.watchNamespaces={team-a,team-b}"], False),
    "namespaced-routing": (
        ["--set", "operator.watchNamespaces={team-a,team-b}", "--set", "routing.enabled=true"],
        True,
    ),
    "peering-routing": (
        [
            "--set",
            "peering.enabled=true",
            "--set",
            "operator.replicas=2",
            "--set",
            "routing.enabled=true",
        ],
        True,
    ),
}


def _helm() -> Path:
    tools = Path(os.environ.get("MMIS_TOOLS_DIR") or Path.home() / ".cache" / "mmis" / "tools")
    helm = tools / "bin" / "helm"
    if not helm.is_file():
        reason = f"{helm} not built: run scripts/gotools helm (or set MMIS_TOOLS_DIR)"
        if in_ci():
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return helm


def render(chart: Path, *values: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(_helm()), "template", "rel", str(chart), "--namespace", RELEASE_NS,
         "--kube-version", "1.33.0", *values],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def _docs(chart: Path, *values: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(render(chart, *values).stdout) if doc]


def _rules(docs: Iterable[Mapping[str, Any]]) -> Iterable[tuple[str, Mapping[str, Any]]]:
    for doc in docs:
        if doc.get("kind") in ("Role", "ClusterRole"):
            where = f"{doc['kind']}/{doc['metadata']['name']}"
            for rule in doc.get("rules") or []:
                yield where, rule


def violations(docs: list[dict[str, Any]], routing_enabled: bool) -> list[str]:
    """Every rule of the rendered RBAC that breaks least privilege, in words."""
    found: list[str] = []
    for doc in docs:
        kind, meta = doc.get("kind"), doc.get("metadata") or {}
        if kind in ("Role", "RoleBinding") and meta.get("namespace") == "kube-system":
            found.append(f"{kind}/{meta['name']} in kube-system")
    for where, rule in _rules(docs):
        groups = set(rule.get("apiGroups") or [])
        resources = set(rule.get("resources") or [])
        verbs = set(rule.get("verbs") or [])
        names = set(rule.get("resourceNames") or [])
        said = f"{where}: {sorted(verbs)} on {sorted(resources)}"
        fields = (groups, resources, verbs, names, set(rule.get("nonResourceURLs") or []))
        if any("*" in value for field in fields for value in field):
            found.append(f"{said}: a wildcard")
        if verbs & {"escalate", "impersonate"}:
            found.append(f"{said}: escalate/impersonate")
        core = "" in groups
        if core and {"secrets", "secrets/*"} & resources and verbs - {"create"}:
            found.append(f"{said}: secrets beyond create")
        if core and "configmaps" in resources and verbs & WRITES:
            found.append(f"{said}: configmap writes")
        if RBAC in groups:
            for resource in resources & {"roles", "clusterroles", "clusterrolebindings"}:
                allowed = (
                    resource == "clusterroles"
                    and verbs == {"bind"}
                    and names == {PICKER_ROLE}
                    and resources == {"clusterroles"}
                )
                if not allowed:
                    found.append(f"{said}: {resource} beyond bind on the picker's ClusterRole")
        if not routing_enabled:
            touched = resources & {"secrets", "serviceaccounts", "rolebindings"}
            if touched and verbs:
                found.append(f"{said}: {sorted(touched)} without routing.enabled")
    return found


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rendered_rbac_is_least_privilege(name: str) -> None:
    values, routing_enabled = VALUE_SETS[name]
    docs = _docs(CHART, *values)
    assert [d for d in docs if d["kind"] in ("Role", "ClusterRole")]
    assert violations(docs, routing_enabled) == []


def test_routing_rights_are_behind_the_value_and_bind_only_the_pickers_role() -> None:
    plain = _docs(CHART)
    routed = _docs(CHART, "--set", "routing.enabled=true")
    names = {d["metadata"]["name"] for d in routed if d["kind"] == "ClusterRole"}
    assert PICKER_ROLE in names
    assert PICKER_ROLE not in {d["metadata"]["name"] for d in plain if d["kind"] == "ClusterRole"}
    binds = [rule for _, rule in _rules(routed) if "bind" in rule.get("verbs", [])]
    assert binds == [
        {
            "apiGroups": [RBAC],
            "resources": ["clusterroles"],
            "verbs": ["bind"],
            "resourceNames": [PICKER_ROLE],
        }
    ]
    secrets = [rule for _, rule in _rules(routed) if "secrets" in rule.get("resources", [])]
    assert [rule["verbs"] for rule in secrets] == [["create"]]
    # the operator's Deployment names that role; without routing, no role to bind
    (dep,) = [d for d in routed if d["kind"] == "Deployment"]
    assert (
        f"--picker-cluster-role={PICKER_ROLE}"
        in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    (plain_dep,) = [d for d in plain if d["kind"] == "Deployment"]
    args = plain_dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--picker-cluster-role") for a in args)


def test_the_pickers_cluster_role_is_exactly_what_the_picker_needs() -> None:
    """One owner: the chart's ClusterRole grants routing.PICKER_RULES, nothing more."""
    docs = _docs(CHART, "--set", "routing.enabled=true")
    (role,) = [
        d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == PICKER_ROLE
    ]
    assert role["rules"] == list(routing.PICKER_RULES)


def test_watching_kube_system_is_refused() -> None:
    proc = render(CHART, "--set", "operator.watchNamespaces={team-a,kube-system}", check=False)
    assert proc.returncode != 0
    assert "kube-system" in proc.stderr


def test_the_checker_catches_each_forbidden_rule() -> None:
    def role(*rules: dict[str, Any], namespace: str | None = None) -> list[dict[str, Any]]:
        meta: dict[str, Any] = {"name": "x"}
        if namespace:
            meta["namespace"] = namespace
        return [
            {"kind": "Role" if namespace else "ClusterRole", "metadata": meta, "rules": list(rules)}
        ]

    bad = {
        "secrets get": {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]},
        "wildcard": {"apiGroups": ["apps"], "resources": ["*"], "verbs": ["get"]},
        "escalate": {"apiGroups": [RBAC], "resources": ["clusterroles"], "verbs": ["escalate"]},
        "impersonate": {"apiGroups": [""], "resources": ["users"], "verbs": ["impersonate"]},
        "configmaps patch": {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["patch"]},
        "roles create": {"apiGroups": [RBAC], "resources": ["roles"], "verbs": ["create"]},
        "bind any": {"apiGroups": [RBAC], "resources": ["clusterroles"], "verbs": ["bind"]},
        "bind other": {
            "apiGroups": [RBAC],
            "resources": ["clusterroles"],
            "verbs": ["bind"],
            "resourceNames": ["cluster-admin"],
        },
        "crb": {"apiGroups": [RBAC], "resources": ["clusterrolebindings"], "verbs": ["create"]},
    }
    for what, rule in bad.items():
        assert violations(role(rule), routing_enabled=True), what
    fine = {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}
    assert violations(role(fine, namespace="kube-system"), routing_enabled=True)
    assert violations(role(fine), routing_enabled=True) == []
    rolebindings = {"apiGroups": [RBAC], "resources": ["rolebindings"], "verbs": ["create"]}
    assert violations(role(rolebindings), routing_enabled=True) == []
    assert violations(role(rolebindings), routing_enabled=False)


def _chart_before_fix(tmp_path: Path) -> Path:
    """The chart at :data:`BEFORE_FIX`, from git (skipped where the history is missing)."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", BEFORE_FIX, "charts/mmis"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if listed.returncode != 0 or not listed.stdout.strip():
        pytest.skip(f"git history without {BEFORE_FIX}: {listed.stderr.strip()}")
    for path in listed.stdout.split():
        blob = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{BEFORE_FIX}:{path}"],
            capture_output=True, check=True,
        )  # fmt: skip
        out = tmp_path / path
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(blob.stdout)
    return tmp_path / "charts" / "mmis"


def test_the_chart_before_the_fix_fails_the_check(tmp_path: Path) -> None:
    """The check can fail: the chart issue 41 found breaks it in the default install."""
    _helm()
    old = _chart_before_fix(tmp_path)
    found = violations(_docs(old), routing_enabled=False)
    assert any("configmap writes" in v for v in found), found
    assert any("roles beyond bind" in v for v in found), found
    assert any("without routing.enabled" in v for v in found), found
