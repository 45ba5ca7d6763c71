"""Every example resource validates against the CRD's schema and parses and builds (the API
server also checks them, CEL rules included, in tests/kube/test_crd_mmis.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from mmis_operator import builders
from mmis_operator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
CRD = ROOT / "crds" / "mminferenceservice.yaml"
_TYPES: dict[str, Any] = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "integer": int,
    "number": (int, float),
}


def _schema() -> dict[str, Any]:
    (version,) = yaml.safe_load(CRD.read_text())["spec"]["versions"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def problems(value: Any, schema: dict[str, Any], where: str = "") -> list[str]:
    """What the CRD's structural schema refuses in ``value`` (CEL rules aside); unknown fields
    are refused too (the API server would prune them, silently)."""
    kind = schema.get("type")
    if kind is not None:
        if isinstance(value, bool) and kind in ("integer", "number"):
            return [f"{where}: {value!r} is not {kind}"]
        if not isinstance(value, _TYPES[kind]):
            return [f"{where}: {value!r} is not {kind}"]
    found: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        found.append(f"{where}: {value!r} not in {schema['enum']}")
    for rule in schema.get("x-kubernetes-validations") or ():  # the choices, as CEL rules
        choices = re.fullmatch(r"self in \[(.*)\]", rule["rule"])
        if choices and value not in re.findall(r"'([^']*)'", choices[1]):
            found.append(f"{where}: {rule['message']}")
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        found.append(f"{where}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            found.append(f"{where}: {value} < {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            found.append(f"{where}: {value} > {schema['maximum']}")
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        found += [f"{where}.{k}: required" for k in schema.get("required", []) if k not in value]
        for key, sub in value.items():
            if key in props:
                found += problems(sub, props[key], f"{where}.{key}")
            elif "additionalProperties" in schema:
                found += problems(sub, schema["additionalProperties"], f"{where}.{key}")
            elif props and not schema.get("x-kubernetes-preserve-unknown-fields"):
                found.append(f"{where}.{key}: not a field of the CRD")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += problems(item, schema["items"], f"{where}[{i}]")
    return found


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 3


def test_the_validator_catches_typos_and_bad_values() -> None:
    bad = yaml.safe_load((ROOT / "examples" / "llava-pvc-token.yaml").read_text())
    bad["spec"]["autoscaling"]["maxReplica"] = 4  # a typo
    bad["spec"]["autoscaling"]["metric"] = "vllm:num_requests_waiting"
    bad["spec"]["autoscaling"]["minReplicas"] = 0
    found = problems(bad, _schema())
    assert len(found) == 3, found


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_matches_the_crd_schema(path: Path) -> None:
    assert problems(yaml.safe_load(path.read_text()), _schema()) == []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_builds(path: Path) -> None:
    obj = yaml.safe_load(path.read_text())
    assert obj["apiVersion"] == "mmis.dev/v1alpha1"
    obj["metadata"].update(namespace="ns", uid="u")
    dep = builders.deployment(obj, parse_spec(obj["spec"]))
    names = [c["name"] for c in dep["spec"]["template"]["spec"]["containers"]]
    assert names[:2] == ["frontend", "engine"]


def test_an_example_shows_pvc_storage_a_token_and_autoscaling() -> None:
    obj = yaml.safe_load((ROOT / "examples" / "llava-pvc-token.yaml").read_text())
    spec = parse_spec(obj["spec"])
    assert spec.model.storage.create_claim and spec.model.token_secret is not None
    assert spec.autoscaling is not None
    assert "replicas" not in obj["spec"]  # the autoscaler owns it
    quickstart = (ROOT / "scripts" / "kind-quickstart").read_text()
    assert "examples/" in quickstart and "llava-pvc-token" in quickstart
