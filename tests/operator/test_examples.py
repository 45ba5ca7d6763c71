"""Every example resource parses and builds (the API server checks them in tests/kube)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mmis_operator import children
from mmis_operator.spec import parse_spec

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 3


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_builds(path: Path) -> None:
    obj = yaml.safe_load(path.read_text())
    assert obj["apiVersion"] == "mmis.dev/v1alpha1"
    obj["metadata"].update(namespace="ns", uid="u")
    dep = children.deployment(obj, parse_spec(obj["spec"]))
    names = [c["name"] for c in dep["spec"]["template"]["spec"]["containers"]]
    assert names[:2] == ["frontend", "engine"]
