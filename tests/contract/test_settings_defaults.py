"""One home per setting: every server setting has exactly one default, its settings field.

The one definition is the fields of ``EngineConfig`` (P1) and ``FrontendConfig`` (P0), with
the shared ones from ``mmis.config.SHARED_SETTINGS``. This test fails when a second default
appears anywhere a setting is derived: the ``mmis engine`` / ``frontend`` / ``serve``
parsers, the env layer, ``SchedulerConfig``, or the operator (its ``spec.DEFAULTS``, the CRD,
and the pod command lines of a minimal ``MMInferenceService``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from mmis.cli import COMMANDS
from mmis.config import SHARED_SETTINGS, GiB, default_of, from_env
from mmis.cpus import engine_threads
from mmis.engine import batch_limits
from mmis.engine.config import EngineConfig
from mmis.engine.scheduling.sched_config import SchedulerConfig
from mmis.entrypoints import engine as engine_cli
from mmis.entrypoints import frontend as frontend_cli
from mmis.entrypoints import serve as serve_cli
from mmis.frontend.config import FrontendConfig
from mmis_operator import builders
from mmis_operator import spec as operator_spec

ROOT = Path(__file__).resolve().parents[2]
CRDS = [
    ROOT / "crds/mminferenceservice.yaml",
]
SECTIONS = {"ENGINE": EngineConfig, "FRONTEND": FrontendConfig}
MINIMAL = {
    "apiVersion": "mmis.dev/v1alpha1",
    "kind": "MMInferenceService",
    "metadata": {"name": "m", "namespace": "ns", "uid": "u"},
    "spec": {"model": {"id": "acme/vlm"}},
}
# settings the operator sets on purpose in every pod (not a default: the pod's own wiring)
POD_WIRING = {
    "frontend": {"model", "served_model_name", "host", "port", "ops_port"}
    | {"engine_input_address", "engine_output_address"}
    | {"drain_lock"},  # the engine's preStop waits on it (termination in order)
    "engine": {"model", "input_address", "output_address", "health_port"},
}
# server settings the operator needs the value of itself (volume and memory sizing)
OPERATOR_NEEDS = {
    "frontend": {"mm_cache_type", "mm_cache_gb"},
    "engine": {"mm_cache_type", "mm_cache_gb"},
}
# CRD path (below spec) -> (settings class, field, CRD value -> server value)
CRD_TO_SERVER: dict[str, tuple[type, str, Any]] = {
    "cache.type": (FrontendConfig, "mm_cache_type", str),
    "cache.size": (FrontendConfig, "mm_cache_gb", lambda v: _bytes(v) / GiB),
    "cache.engineSize": (EngineConfig, "mm_cache_gb", lambda v: _bytes(v) / GiB),
    "cache.shmSize": (FrontendConfig, "shm_gb", lambda v: _bytes(v) / GiB),
    "cache.driftWindowSeconds": (FrontendConfig, "drift_window_s", float),
    "engine.maxNumSeqs": (EngineConfig, "max_num_seqs", int),
    "engine.maxNumBatchedTokens": (EngineConfig, "max_num_batched_tokens", int),
    "engine.kvCacheMemory": (EngineConfig, "kv_cache_gb", lambda v: _bytes(v) / GiB),
    "engine.faultEvictRate": (EngineConfig, "fault_evict_rate", float),
    "telemetry.otlpEndpoint": (FrontendConfig, "otlp_traces_endpoint", str),
    "allowedLocalMediaPath": (FrontendConfig, "allowed_local_media_path", str),
    "model.revision": (FrontendConfig, "revision", str),
    "model.servedName": (FrontendConfig, "served_model_name", str),
}


def _bytes(value: str) -> int:
    return operator_spec.parse_bytes(value, "test")


def _parser(module: Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    module.add_arguments(parser)
    return parser


def _crd_defaults(schema: dict[str, Any], path: str = "") -> dict[str, Any]:
    found = {}
    for key, sub in (schema.get("properties") or {}).items():
        where = f"{path}.{key}" if path else key
        if "default" in sub and sub["default"] != {}:
            found[where] = sub["default"]
        found.update(_crd_defaults(sub, where))
    return found


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith(("MMIS_", "OTEL_")) or key == "OMP_NUM_THREADS":
            monkeypatch.delenv(key)


@pytest.mark.parametrize("name", ["engine", "frontend", "serve"])
def test_parsers_have_no_default_of_their_own(name: str) -> None:
    parser = _parser(importlib.import_module(COMMANDS[name][0]))
    own = {
        action.dest: action.default
        for action in parser._actions
        if action.dest != "help" and action.default not in (None, argparse.SUPPRESS)
    }
    assert not own, f"mmis {name}: options with a default besides the dataclass's: {own}"


@pytest.mark.parametrize(
    ("module", "cls"), [(engine_cli, EngineConfig), (frontend_cli, FrontendConfig)]
)
def test_every_field_is_an_option_and_every_option_a_field(module: Any, cls: type) -> None:
    dests = {a.dest for a in _parser(module)._actions} - {"help"}
    assert dests == {f.name for f in dataclasses.fields(cls)}


def test_serve_takes_the_front_end_flags_and_every_engine_setting(clean_env: None) -> None:
    parser = _parser(serve_cli)
    flags = set(parser._option_string_actions)
    assert set(_parser(frontend_cli)._option_string_actions) <= flags
    # every engine flag but the status file, which serve sets for its child itself
    assert set(_parser(engine_cli)._option_string_actions) - {"--status-file"} <= flags
    assert "--status-file" not in flags
    # with no flags, the child P1 gets no engine-only value but its threads, sized for the
    # CPUs it shares with the front ends (mmis/cpus.py): its own defaults apply to the rest
    args = parser.parse_args([])
    child = serve_cli.engine_settings(args, serve_cli.frontend_settings(args))
    engine_only = {f.name for f in dataclasses.fields(EngineConfig) if "shared" not in f.metadata}
    assert set(child) & engine_only == {"model", "threads"}
    assert child["threads"] == engine_threads(1)
    expected = EngineConfig(threads=engine_threads(1))
    assert from_env(EngineConfig, "engine", environ={}, **child) == expected


def test_serve_leaves_p1s_threads_to_the_environment_when_it_sizes_them(
    clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = _parser(serve_cli)
    args = parser.parse_args(["--api-servers", "2"])
    settings = serve_cli.frontend_settings(args)
    assert serve_cli.engine_settings(args, settings)["threads"] == engine_threads(2)
    for name in ("OMP_NUM_THREADS", "MMIS_ENGINE_THREADS"):
        monkeypatch.setenv(name, "3")
        assert "threads" not in serve_cli.engine_settings(args, settings)
        monkeypatch.delenv(name)
    args = parser.parse_args(["--threads", "5"])
    assert serve_cli.engine_settings(args, serve_cli.frontend_settings(args))["threads"] == 5


def test_parsers_with_no_flags_give_the_dataclass_defaults(clean_env: None) -> None:
    assert engine_cli.config_from_args(_parser(engine_cli).parse_args([])) == EngineConfig()
    front = frontend_cli.settings_from(_parser(frontend_cli).parse_args(["--model", "m"]))
    assert front == FrontendConfig(model="m")


@pytest.mark.parametrize(("section", "cls"), sorted(SECTIONS.items()))
def test_an_empty_environment_gives_the_dataclass_defaults(section: str, cls: type) -> None:
    assert from_env(cls, section, environ={}) == cls()


def test_no_variable_names_a_missing_field() -> None:
    pattern = re.compile(r"MMIS_(ENGINE|FRONTEND)_([A-Z0-9_]+)")
    fields = {s: {f.name.upper() for f in dataclasses.fields(c)} for s, c in SECTIONS.items()}
    sources = [*ROOT.glob("server/**/*.py"), *ROOT.glob("operator/**/*.py"), ROOT / "README.md"]
    sources += ROOT.glob("docs/**/*.md")  # the site holds what the README used to
    sources += [*ROOT.glob("charts/**/*.yaml"), *ROOT.glob("examples/*.yaml")]
    dead = {
        f"{path.relative_to(ROOT)}: {m.group(0)}"
        for path in sources
        for m in pattern.finditer(path.read_text())
        if m.group(2) not in fields[m.group(1)] and not m.group(2).endswith("_")
    }
    assert not dead


def test_shared_settings_have_one_definition() -> None:
    for cls in (EngineConfig, FrontendConfig):
        for field in dataclasses.fields(cls):
            name = field.metadata.get("shared")
            if name is None:
                continue
            one = SHARED_SETTINGS[name]
            assert field.default == one["default"] and field.metadata["help"] == one["help"]
    # a setting both processes read is shared, or deliberately separate (P0 needs a model)
    engine = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for field in dataclasses.fields(FrontendConfig):
        if field.name in engine and field.name != "model":
            assert field.metadata.get("shared") == engine[field.name].metadata.get("shared")
            assert "shared" in field.metadata, field.name


def test_scheduler_defaults_are_the_engine_settings() -> None:
    for name in ("block_size", "enable_prefix_caching", "max_model_len"):
        assert default_of(SchedulerConfig, name) == default_of(EngineConfig, name), name
    # the batch limits default to "chosen at start-up": without a profile, the fixed ones
    unset = batch_limits.resolve(
        default_of(EngineConfig, "max_num_seqs"), default_of(EngineConfig, "max_num_batched_tokens")
    )
    assert (unset.seqs_source, unset.tokens_source) == ("default", "default")
    assert default_of(SchedulerConfig, "max_num_seqs") == unset.max_num_seqs
    assert default_of(SchedulerConfig, "max_num_batched_tokens") == unset.max_num_batched_tokens


@pytest.mark.parametrize("crd", CRDS, ids=lambda p: str(p.relative_to(ROOT)))
def test_operator_defaults_of_server_settings_are_the_servers(crd: Path) -> None:
    doc = yaml.safe_load(crd.read_text())
    schema = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    sources = {"CRD": _crd_defaults(schema), "spec.DEFAULTS": operator_spec.DEFAULTS}
    for where, defaults in sources.items():
        for path, (cls, name, convert) in CRD_TO_SERVER.items():
            if path in defaults:
                got = convert(defaults[path])
                assert got == default_of(cls, name), f"{where} {path}={got}: server has {name}"


def test_a_minimal_resource_runs_the_server_defaults(
    clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    obj = copy.deepcopy(MINIMAL)
    parsed = operator_spec.parse_spec(obj["spec"])
    pod = builders.deployment(obj, parsed)["spec"]["template"]["spec"]
    by_name = {c["name"]: c for c in pod["containers"]}
    for name, module, build in (
        ("frontend", frontend_cli, frontend_cli.settings_from),
        ("engine", engine_cli, engine_cli.config_from_args),
    ):
        container = by_name[name]
        assert container["command"] == ["mmis"] and container["args"][0] == name
        with monkeypatch.context() as patch:
            for item in container.get("env", []):
                if "value" in item:
                    patch.setenv(item["name"], item["value"])
            args = _parser(module).parse_args(container["args"][1:])
            settings = build(args)
        # flags only for the pod's wiring and the cache sizes the operator itself needs
        passed = {dest for dest, value in vars(args).items() if value is not None}
        assert passed <= POD_WIRING[name] | OPERATOR_NEEDS[name], f"{name}: passes {passed}"
        cls = type(settings)
        differ = {
            f.name: getattr(settings, f.name)
            for f in dataclasses.fields(cls)
            if getattr(settings, f.name) != default_of(cls, f.name)
        }
        assert set(differ) <= POD_WIRING[name], f"{name}: operator defaults {differ}"
