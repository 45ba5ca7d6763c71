"""Serving settings in the spec (issue 48 item 6): ``spec.engine.dtype`` and the other
``mmis serve`` settings that matter in a pod (``spec.ENGINE_FLAGS``, ``spec.FRONTEND_FLAGS``)
reach the real ``mmis engine`` / ``mmis frontend`` parsers as the values the user wrote.

- Every field set: the two containers' args are byte for byte golden/serving_settings.json,
  and the server's own parser turns them into exactly the spec's values (camelCase field ->
  snake_case setting); unset fields pass no flag (the older goldens stay as they were).
- The CRD's schema of each field equals the table (type, enum, bounds), and every property of
  ``spec.engine`` / ``spec.frontend`` is either in the table or one of the older fields.
- A wrong value is an :class:`InvalidSpecError` naming the field (the operator's own check,
  behind the API server's).

Regenerate the golden file (only for an intended change; review the diff and say in the commit
what changed): ``.venv/bin/python tests/operator/test_serving_settings.py --write-golden NOTE``.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from mmis.entrypoints import engine as engine_cli
from mmis.entrypoints import frontend as frontend_cli
from mmis_operator import builders
from mmis_operator import kube as r
from mmis_operator.spec import (
    ENGINE_FLAGS,
    FRONTEND_FLAGS,
    InvalidSpecError,
    ServerFlag,
    parse_spec,
)

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden" / "serving_settings.json"
CRD = yaml.safe_load((ROOT / "crds" / "mminferenceservice.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
OLDER = {  # spec.engine / spec.frontend fields with their own handling in the builders
    "engine": {"maxNumSeqs", "maxNumBatchedTokens", "kvCacheMemory", "faultEvictRate"},
    "frontend": {"apiServers"},
    "telemetry": {"otlpEndpoint", "samplingRatio"},
}
# a value of every setting, none of them the server's default
EVERY: dict[str, dict[str, Any]] = {
    "engine": {
        "dtype": "float16",
        "maxModelLen": 8192,
        "gpuMemoryUtilization": 0.85,
        "blockSize": 32,
        "enablePrefixCaching": False,
        "enforceEager": True,
        "asyncScheduling": "off",
        "attentionBackend": "torch",
        "encoderCacheTokens": 16384,
        "selfCheck": False,
        "maxLoras": 2,
        "maxLoraRank": 32,
        "maxCpuLoras": 4,
    },
    "frontend": {
        "maxImagesPerPrompt": 4,
        "maxVideosPerPrompt": 0,
        "videoFps": 1.5,
        "videoMinFrames": 2,
        "videoMaxFrames": 16,
        "mediaMaxBytes": 10485760,
        "mediaMaxPixels": 12000000,
        "maxRequestBodyMb": 64,
        "maxN": 4,
        "generationConfig": "none",
        "enableMmEmbeds": True,
        "failFast": True,
    },
    "telemetry": {"logLevel": "debug"},  # both sides
}
RESOURCE: dict[str, Any] = {
    "apiVersion": "mmis.dev/v1alpha1",
    "kind": "MMInferenceService",
    "metadata": {"name": "llava", "namespace": "ml", "uid": "uid-golden"},
    "spec": {
        "model": {"id": "llava-hf/llava-1.5-7b-hf"},
        "resources": {"gpus": 1, "memory": "32Gi"},
        **copy.deepcopy(EVERY),
    },
}


def _args(resource: dict[str, Any]) -> dict[str, list[str]]:
    dep = builders.deployment(resource, parse_spec(resource["spec"]))
    return {c["name"]: c["args"] for c in dep["spec"]["template"]["spec"]["containers"]}


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", name).lower()


def write_golden(note: str) -> None:
    """Rewrite the golden args from today's builders, ``note`` appended."""
    old = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"_note": ""}
    args = _args(RESOURCE)
    data = {
        "_note": f"{old['_note']} {note}".strip(),
        "resource": RESOURCE,
        "frontend": args[r.FRONTEND],
        "engine": args[r.ENGINE],
    }
    GOLDEN.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def test_every_setting_renders_the_golden_flags() -> None:
    golden = json.loads(GOLDEN.read_text())
    assert golden["resource"] == RESOURCE
    args = _args(RESOURCE)
    assert args[r.FRONTEND] == golden["frontend"]
    assert args[r.ENGINE] == golden["engine"]


def _parsed(module: Any, argv: list[str]) -> Any:
    parser = argparse.ArgumentParser(exit_on_error=False)
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])  # an unknown flag exits: the test fails
    if module is engine_cli:
        return engine_cli.config_from_args(args)
    return frontend_cli.settings_from(args)


def test_the_servers_parse_the_spec_values() -> None:
    args = _args(RESOURCE)
    engine = _parsed(engine_cli, args[r.ENGINE])
    front = _parsed(frontend_cli, args[r.FRONTEND])
    for key, value in EVERY["engine"].items():
        assert getattr(engine, _snake(key)) == value, key
    for key, value in EVERY["frontend"].items():
        assert getattr(front, _snake(key)) == value, key
    assert front.max_model_len == engine.max_model_len == EVERY["engine"]["maxModelLen"]
    assert front.log_level == engine.log_level == EVERY["telemetry"]["logLevel"]


def test_unset_settings_pass_no_flag() -> None:
    bare = copy.deepcopy(RESOURCE)
    del bare["spec"]["engine"], bare["spec"]["frontend"], bare["spec"]["telemetry"]
    flags = {item.flag for item in (*ENGINE_FLAGS, *FRONTEND_FLAGS)}
    for argv in _args(bare).values():
        assert not flags & set(argv), argv


def _crd_property(item: ServerFlag) -> dict[str, Any]:
    section, key = item.field.split(".")
    return SCHEMA["properties"][section]["properties"][key]


@pytest.mark.parametrize("item", [*ENGINE_FLAGS, *FRONTEND_FLAGS], ids=lambda i: i.field)
def test_crd_schema_matches_the_table(item: ServerFlag) -> None:
    prop = _crd_property(item)
    kind = {"int": "integer", "number": "number", "choice": "string", "switch": "boolean"}
    assert "enum" not in prop and "pattern" not in prop
    assert prop["type"] == kind[item.kind]
    assert prop.get("description")
    if item.kind == "choice":  # a CEL rule, not an enum: a bad choice hides no other check
        (rule,) = prop["x-kubernetes-validations"]
        assert rule["rule"] == "self in [" + ", ".join(f"'{c}'" for c in item.choices) + "]"
        assert rule["message"] == f"spec.{item.field} must be one of {', '.join(item.choices)}"
    if item.kind == "int":
        assert (prop["minimum"], prop["maximum"]) == (item.low, item.high)
    if item.kind == "number":  # bounds as one CEL rule with a message naming the field
        (rule,) = prop["x-kubernetes-validations"]
        assert f"spec.{item.field}" in rule["message"]


def test_every_engine_and_frontend_field_is_known() -> None:
    for section in OLDER:
        table = {i.field.split(".")[1] for i in (*ENGINE_FLAGS, *FRONTEND_FLAGS)}
        fields = set(SCHEMA["properties"][section]["properties"])
        assert fields - OLDER[section] == {k for k in table if k in fields}
        assert fields - OLDER[section] - table == set()


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("engine.dtype", "fp8", "must be one of auto, bfloat16, float16, float32"),
        ("engine.gpuMemoryUtilization", 0, "must be above 0 and at most 1"),
        ("engine.maxModelLen", 1, "must be at least 2"),
        ("engine.enforceEager", "yes", "must be true or false"),
        ("frontend.maxN", 1.5, "must be an integer"),
    ],
)
def test_a_wrong_value_names_the_field(field: str, value: Any, says: str) -> None:
    spec = copy.deepcopy(RESOURCE["spec"])
    section, key = field.split(".")
    spec[section][key] = value
    with pytest.raises(InvalidSpecError, match=re.escape(says)) as caught:
        parse_spec(spec)
    assert caught.value.field == f"spec.{field}"


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--write-golden":
        sys.exit("usage: test_serving_settings.py --write-golden NOTE")
    write_golden(sys.argv[2])
