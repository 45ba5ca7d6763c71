"""Static checks of the CRD file (the API server checks are in tests/kube).

The source is the top-level ``crds/mminferenceservice.yaml`` (``kubectl apply -f crds/``
installs the CRD without Helm); ``charts/mmis/crds/`` keeps a copy because Helm reads only
inside the chart. Invariant: every file of ``crds/`` has a byte-identical copy in the chart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from mmis_operator import kube as r

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"
CHART_CRDS = ROOT / "charts" / "mmis" / "crds"
CRD = CRDS / "mminferenceservice.yaml"


def _crd() -> dict[str, Any]:
    return yaml.safe_load(CRD.read_text())


def test_the_charts_copy_is_the_top_level_file_byte_for_byte() -> None:
    """Each file of ``crds/`` is in ``charts/mmis/crds/`` with the same bytes (the chart also
    holds kopf's peering CRDs, which only the chart installs)."""
    sources = sorted(p.name for p in CRDS.glob("*.yaml"))
    assert "mminferenceservice.yaml" in sources
    for name in sources:
        copy = CHART_CRDS / name
        assert copy.is_file(), f"{copy} is missing: copy crds/{name} into the chart"
        assert copy.read_bytes() == (CRDS / name).read_bytes(), (
            f"charts/mmis/crds/{name} differs from crds/{name}, the source: "
            f"cp crds/{name} charts/mmis/crds/"
        )


def test_names_match_the_operator() -> None:
    crd = _crd()
    assert crd["metadata"]["name"] == f"{r.PLURAL}.{r.GROUP}"
    assert crd["spec"]["group"] == r.GROUP
    assert crd["spec"]["names"]["kind"] == r.KIND
    assert r.SHORT_NAME in crd["spec"]["names"]["shortNames"]
    (version,) = crd["spec"]["versions"]
    assert version["name"] == r.VERSION


def test_scale_and_status_subresources() -> None:
    (version,) = _crd()["spec"]["versions"]
    scale = version["subresources"]["scale"]
    assert scale == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert version["subresources"]["status"] == {}


def test_printer_columns() -> None:
    (version,) = _crd()["spec"]["versions"]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Reason"] == '.status.conditions[?(@.type=="Ready")].reason'
    assert columns["Drift"] == ".status.cache.driftRate"
    assert columns["Model"] == ".status.model"  # the id or the path (issue 48 item 6)
    assert columns["Rollout"] == '.status.conditions[?(@.type=="Progressing")].reason'
    assert {"Replicas", "Age"} <= columns.keys()


def test_cel_rules_are_present() -> None:
    (version,) = _crd()["spec"]["versions"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    cache_rules = [v["rule"] for v in spec["properties"]["cache"]["x-kubernetes-validations"]]
    assert any("shmSize" in rule and "quantity" in rule for rule in cache_rules)
    # no schema minimum: the scale subresource's check refuses a negative count, and a
    # second rule would report it twice (tests/kube/test_crd_mmis.py)
    assert "minimum" not in spec["properties"]["replicas"]
    assert spec["properties"]["resources"]["properties"]["gpus"]["minimum"] == 0
    drift = spec["properties"]["cache"]["properties"]["driftThreshold"]
    assert (drift["minimum"], drift["maximum"]) == (0, 1)


def test_api_servers_bounds_and_the_front_end_requests_have_no_stored_default() -> None:
    """``spec.frontend.apiServers`` is 1..64 (the server's bound) with no CRD default (it is
    derived from the CPU request); the P0 container's requests have none either, so the
    operator can tell unset (one process's request times apiServers) from a value written."""
    (version,) = _crd()["spec"]["versions"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    count = spec["frontend"]["properties"]["apiServers"]
    assert (count["type"], count["minimum"], count["maximum"]) == ("integer", 1, 64)
    assert "default" not in count and "default" not in spec["frontend"]
    assert count["description"] and spec["frontend"]["description"]
    for name in ("frontendCpu", "frontendMemory"):
        field = spec["resources"]["properties"][name]
        assert "default" not in field, name
        assert "per process" in " ".join(field["description"].split()), name
    # printer columns untouched by it
    assert not any("frontend" in c["jsonPath"] for c in version["additionalPrinterColumns"])
