"""The operator's pods against the real server command lines: what the spec asks for is what
``mmis frontend`` / ``mmis engine`` end up running with.

Each container whose command is ``mmis`` is parsed exactly as ``mmis.cli.main`` would parse it
(the subcommand's own ``add_arguments``), with the container's environment applied to
``os.environ``; then the server's own settings builders run (``settings_from`` /
``config_from_args``). Every ``MMIS_*`` variable in a container must be one that container's
server config reads: a dead variable fails here instead of being silently ignored in a pod.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from mmis.cli import COMMANDS
from mmis.config import GiB, default_of
from mmis.engine.config import EngineConfig
from mmis.entrypoints import engine as engine_cli
from mmis.entrypoints import frontend as frontend_cli
from mmis.entrypoints.api_servers import STOP_MARGIN_S
from mmis.frontend.config import FrontendConfig
from mmis.frontend.state import ENCODER_TOKEN_ENV
from mmis_operator import builders
from mmis_operator import kube as r
from mmis_operator.spec import ServiceSpec, parse_spec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
SECRET_VALUE = "from-secret"  # stands in for a secretKeyRef the kubelet would resolve
GB_ROUNDING = 0.00005  # spec.gib keeps 4 decimals
# spec.model.revision / processorKwargs as a platform engineer writes them (nested, unicode)
MODEL_EXTRAS: dict[str, Any] = {
    "revision": "v1.2-rc",
    "processorKwargs": {
        "do_normalize": False,
        "size": {"shortest_edge": 3136, "longest_edge": 12544},
        "image_mean": [0.5, 0.5, 0.5],
        "note": "größe 'quoted' {braces}",
    },
}

# MMIS_* names each command's config layer reads (from_env sections, parser defaults)
READ_ENV = {
    "frontend": {f"MMIS_FRONTEND_{f.name.upper()}" for f in dataclasses.fields(FrontendConfig)}
    | {ENCODER_TOKEN_ENV},
    "engine": {
        f"MMIS_ENGINE_{f.name.upper()}" for f in dataclasses.fields(engine_cli.EngineConfig)
    },
}


def _variants() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in EXAMPLES:
        yield path.stem, yaml.safe_load(path.read_text())
    base = yaml.safe_load((ROOT / "examples" / "llava-lru.yaml").read_text())
    changes: dict[str, dict[str, Any]] = {
        "shm": {"cache": {"type": "shm", "size": "3Gi", "shmSize": "5Gi"}},
        "shm-default-store": {"cache": {"type": "shm", "size": "1536Mi"}},
        "fault-knob": {
            "cache": {"size": "4Gi", "engineSize": "1Gi", "driftWindowSeconds": 30},
            "engine": {"faultEvictRate": 0.25, "maxNumSeqs": 7, "maxNumBatchedTokens": 1024},
        },
        "api-key": {"auth": {"apiKeySecretRef": {"name": "keys", "key": "token"}}},
        "otlp": {"telemetry": {"otlpEndpoint": "http://otel:4317", "samplingRatio": 0.25}},
        "cpu-kv-media": {
            "resources": {"gpus": 0, "memory": "8Gi"},
            "engine": {"kvCacheMemory": "1Gi"},
            "cache": {"size": "512Mi"},
            "allowedLocalMediaPath": "/data",
            "model": {"path": "/models/x", "servedName": "friendly"},
        },
        "revision-processor-kwargs": {"model": {"id": "acme/vlm", **MODEL_EXTRAS}},
        "routing": {"routing": {"cacheWeight": 2}},  # the engine's cache-event flags
        "api-servers": {"frontend": {"apiServers": 4}},  # P0 processes: --api-servers
        # --enable-lora and the LoRA limits; P0's optional internal token
        "adapters": {"adapters": [{"name": "a", "source": "/m/a"}], "engine": {"maxLoras": 2}},
    }
    for name, change in changes.items():
        obj = copy.deepcopy(base)
        obj["spec"].update(change)
        yield name, obj


VARIANTS = dict(_variants())


def _deployment(obj: dict[str, Any]) -> tuple[ServiceSpec, dict[str, Any]]:
    obj = copy.deepcopy(obj)
    obj["metadata"].update(namespace="ns", uid="u")
    spec = parse_spec(obj["spec"])
    return spec, builders.deployment(obj, spec)


def _env_value(item: dict[str, Any]) -> str:
    if "value" in item:
        return str(item["value"])
    source = item.get("valueFrom", {})
    if "secretKeyRef" in source:
        return SECRET_VALUE
    return f"<{item['name']}>"  # fieldRef etc.: the kubelet fills these


def _parse(container: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The settings the server builds from this container's command, args and env."""
    argv = [*container.get("command", []), *container.get("args", [])]
    assert argv[0] == "mmis", f"{container['name']}: not an mmis command: {argv}"
    assert not any("$(" in a for a in argv), f"unexpanded variable in {argv}"
    for key in list(os.environ):
        if key.startswith(("MMIS_", "OTEL_")):
            monkeypatch.delenv(key)
    for item in container.get("env", []):
        monkeypatch.setenv(item["name"], _env_value(item))
    name, rest = argv[1], argv[2:]
    assert name in COMMANDS, f"unknown mmis subcommand {name!r}"
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"mmis {name}", exit_on_error=False)
    module.add_arguments(parser)
    args = parser.parse_args(rest)  # an unknown flag raises SystemExit: the test fails
    if module is frontend_cli:
        return frontend_cli.settings_from(args)
    if module is engine_cli:
        return engine_cli.config_from_args(args)
    return args


def _or_default(value: Any, cls: type, name: str) -> Any:
    """What the server runs with: the spec's value, or (unset, not passed) its own default."""
    return default_of(cls, name) if value is None else value


def _gib(value: float, expected_bytes: int) -> bool:
    return abs(value - expected_bytes / GiB) <= GB_ROUNDING


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_no_dead_mmis_environment(variant: str) -> None:
    _, dep = _deployment(VARIANTS[variant])
    for container in dep["spec"]["template"]["spec"]["containers"]:
        if container["name"] not in READ_ENV:
            continue
        names = {e["name"] for e in container.get("env", []) if e["name"].startswith("MMIS_")}
        dead = names - READ_ENV[container["name"]]
        assert not dead, f"{variant}/{container['name']}: nobody reads {sorted(dead)}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_mmis_command_in_the_pod_parses(
    variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, dep = _deployment(VARIANTS[variant])
    pod = dep["spec"]["template"]["spec"]
    commands = [
        c for c in pod.get("initContainers", []) + pod["containers"] if c.get("command") == ["mmis"]
    ]
    assert {r.FRONTEND, r.ENGINE} <= {c["name"] for c in commands}
    for container in commands:
        with monkeypatch.context() as patch:
            _parse(container, patch)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_server_settings_match_the_spec(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec, dep = _deployment(VARIANTS[variant])
    pod = dep["spec"]["template"]["spec"]
    by_name = {c["name"]: c for c in pod["containers"]}
    front_c, engine_c = by_name[r.FRONTEND], by_name[r.ENGINE]
    with monkeypatch.context() as patch:
        settings = _parse(front_c, patch)
    with monkeypatch.context() as patch:
        engine = _parse(engine_c, patch)

    # the model and its name
    assert settings.model == engine.model == spec.model.name
    # its revision on both sides; processor kwargs on the only side that runs the processor
    assert settings.revision == engine.revision == spec.model.revision
    assert settings.processor_kwargs == spec.model.processor_kwargs
    assert "--processor-kwargs" not in engine_c["args"]
    assert settings.model_name == spec.model.served_name
    # one engine, both ends agree on its sockets
    assert settings.engine_input_address == engine.input_address == r.ENGINE_INPUT_ADDRESS
    assert settings.engine_output_address == engine.output_address == r.ENGINE_OUTPUT_ADDRESS
    # caches: type, shadow budget, receiver budget (equal unless engineSize says otherwise)
    assert settings.mm_cache_type == engine.mm_cache_type == spec.cache.type
    assert _gib(settings.mm_cache_gb, spec.cache.size_bytes)
    receiver = spec.cache.engine_size_bytes or spec.cache.size_bytes
    assert _gib(engine.mm_cache_gb, receiver)
    if spec.cache.engine_size_bytes is None:
        assert settings.mm_cache_gb == engine.mm_cache_gb
    assert settings.drift_window_s == _or_default(
        spec.cache.drift_window_seconds, FrontendConfig, "drift_window_s"
    )
    # shared memory: both on the memory-backed volume, the writer sized to the store
    shm_mounts = {
        c["name"]: m["mountPath"]
        for c in (front_c, engine_c)
        for m in c["volumeMounts"]
        if m["name"] == r.SHM_VOLUME
    }
    assert settings.shm_dir == engine.shm_dir == shm_mounts[r.FRONTEND] == shm_mounts[r.ENGINE]
    (volume,) = [v for v in pod["volumes"] if v["name"] == r.SHM_VOLUME]
    assert volume["emptyDir"]["medium"] == "Memory"
    if spec.cache.type == "shm":
        assert _gib(settings.shm_gb, spec.cache.shm_store_bytes)
    # engine knobs
    assert engine.fault_evict_rate == (spec.fault_evict_rate or 0.0)
    assert engine.max_num_seqs == _or_default(spec.max_num_seqs, EngineConfig, "max_num_seqs")
    assert engine.max_num_batched_tokens == _or_default(
        spec.max_num_batched_tokens, EngineConfig, "max_num_batched_tokens"
    )
    if spec.kv_cache_bytes is None:
        assert engine.kv_cache_gb is None
    else:
        assert engine.kv_cache_gb is not None and _gib(engine.kv_cache_gb, spec.kv_cache_bytes)
    # telemetry, auth, media
    assert settings.otlp_traces_endpoint == engine.otlp_traces_endpoint == spec.otlp_endpoint
    assert settings.api_key == (SECRET_VALUE if spec.api_key_secret else None)
    assert settings.allowed_local_media_path == spec.allowed_local_media_path
    assert settings.api_servers == spec.api_servers
    # spec.encoder: the encoders' headless Service in the resource's namespace ("ns" here)
    service = builders.encoder_service(dep["metadata"]["name"], "ns") if spec.encoder else None
    assert settings.encoder_service == service
    # the port the probes and the Service use is the one the server binds; the operations
    # port (what Prometheus and the coherence probe reach, pod to pod) is the one it opens
    http, ops = front_c["ports"]
    assert http["name"] == r.HTTP_PORT_NAME and http["containerPort"] == settings.port
    assert ops["name"] == r.OPS_PORT_NAME and ops["containerPort"] == settings.ops_port
    assert settings.host == "0.0.0.0"  # a pod must listen on its pod IP


def test_revision_and_processor_kwargs_reach_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both fields set in the resource come out as the server's own config values."""
    _, dep = _deployment(VARIANTS["revision-processor-kwargs"])
    by_name = {c["name"]: c for c in dep["spec"]["template"]["spec"]["containers"]}
    with monkeypatch.context() as patch:
        settings = _parse(by_name[r.FRONTEND], patch)
    with monkeypatch.context() as patch:
        engine = _parse(by_name[r.ENGINE], patch)
    assert settings.revision == engine.revision == MODEL_EXTRAS["revision"]
    assert settings.processor_kwargs == MODEL_EXTRAS["processorKwargs"]
    # and the resources that leave them unset give the server's defaults
    _, plain = _deployment(VARIANTS["llava-lru"])
    front_c = plain["spec"]["template"]["spec"]["containers"][0]
    with monkeypatch.context() as patch:
        settings = _parse(front_c, patch)
    assert settings.revision is None and settings.processor_kwargs == {}


def test_probe_and_scrape_paths_are_front_end_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    from mmis.frontend.api.api_server import create_app

    _, dep = _deployment(VARIANTS["llava-lru"])
    front_c = dep["spec"]["template"]["spec"]["containers"][0]
    with monkeypatch.context() as patch:
        settings = _parse(front_c, patch)
    app = create_app(settings)  # the lifespan (engine connection) does not run here
    routes = {getattr(route, "path", None) for route in app.routes}
    probes = {
        front_c[kind]["httpGet"]["path"]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe")
    }
    assert probes == {"/health", "/ready"}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert front_c[kind]["httpGet"]["port"] == r.HTTP_PORT_NAME
    # /stats/cache: the operator's drift probe; /metrics: Prometheus
    assert probes | {"/stats/cache", "/metrics"} <= routes
    # the engine container's probes hit the port its own --health-port opens
    engine_c = dep["spec"]["template"]["spec"]["containers"][1]
    with monkeypatch.context() as patch:
        engine_cfg = _parse(engine_c, patch)
    (port,) = engine_c["ports"]
    assert engine_cfg.health_port == port["containerPort"]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine_c[kind]["httpGet"]["port"] == port["name"]


def test_routing_event_endpoints_bind_the_named_engine_ports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With spec.routing the engine publishes both event streams (and their replays) on the
    ports its container declares, which are the ones the picker's config subscribes to."""
    from mmis_operator import routing

    _, dep = _deployment(VARIANTS["routing"])
    engine_c = {c["name"]: c for c in dep["spec"]["template"]["spec"]["containers"]}[r.ENGINE]
    with monkeypatch.context() as patch:
        engine = _parse(engine_c, patch)
    ports = {p["name"]: p["containerPort"] for p in engine_c["ports"]}
    endpoints = {
        "kv-events": engine.kv_events_endpoint,
        "kv-replay": engine.kv_events_replay_endpoint,
        "mm-events": engine.mm_events_endpoint,
        "mm-replay": engine.mm_events_replay_endpoint,
    }
    assert endpoints == {name: f"tcp://*:{ports[name]}" for name in endpoints}
    params = routing.picker_config(ops_port=r.OPS_PORT)["plugins"][0]["parameters"]
    assert [
        params[k] for k in ("kvEventsPort", "kvReplayPort", "mmEventsPort", "mmReplayPort")
    ] == [ports[name] for name in endpoints]
    assert routing.EventPorts() == routing.EVENT_PORTS
    # and without spec.routing the engine publishes nothing
    _, plain = _deployment(VARIANTS["llava-lru"])
    plain_engine = plain["spec"]["template"]["spec"]["containers"][1]
    with monkeypatch.context() as patch:
        assert _parse(plain_engine, patch).kv_events_endpoint is None


@pytest.mark.parametrize("variant", ["llava-lru", "routing", "api-servers"])
def test_engine_prestop_waits_on_the_front_ends_drain_lock(
    variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Termination in order (docs/SECURITY.md): the engine's preStop is a real ``mmis
    wait-frontend`` command line on the lock the front end's own settings hold, waiting at
    least the front end's preStop pause plus its graceful shutdown, within the grace period."""
    spec, dep = _deployment(VARIANTS[variant])
    pod = dep["spec"]["template"]["spec"]
    by_name = {c["name"]: c for c in pod["containers"]}
    with monkeypatch.context() as patch:
        settings = _parse(by_name[r.FRONTEND], patch)
    hook = by_name[r.ENGINE]["lifecycle"]["preStop"]["exec"]["command"]
    with monkeypatch.context() as patch:
        waits = _parse({"name": "prestop", "command": hook[:1], "args": hook[1:]}, patch)
    assert hook[1] == "wait-frontend"
    assert waits.lock == settings.drain_lock == builders.DRAIN_LOCK
    # the operator leaves --graceful-shutdown-s at the server's default and counts on it
    assert "--graceful-shutdown-s" not in by_name[r.FRONTEND]["args"]
    graceful = default_of(FrontendConfig, "graceful_shutdown_s")
    assert builders.FRONTEND_GRACEFUL_SECONDS == settings.graceful_shutdown_s == graceful
    # several P0s: the supervisor kills a draining child STOP_MARGIN_S after its graceful time
    assert builders.API_SERVERS_STOP_MARGIN_SECONDS == STOP_MARGIN_S
    margin = STOP_MARGIN_S if settings.api_servers > 1 else 0
    assert waits.timeout_s > spec.drain_seconds + settings.graceful_shutdown_s + margin
    assert pod["terminationGracePeriodSeconds"] > waits.timeout_s


def test_routing_token_reaches_both_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """With spec.routing the internal token (a secretKeyRef) is P0's --internal-token and
    P1's --events-token, and never a flag; without it neither is set."""
    for variant, expected in (("routing", SECRET_VALUE), ("llava-lru", None)):
        _, dep = _deployment(VARIANTS[variant])
        by_name = {c["name"]: c for c in dep["spec"]["template"]["spec"]["containers"]}
        with monkeypatch.context() as patch:
            settings = _parse(by_name[r.FRONTEND], patch)
        with monkeypatch.context() as patch:
            engine = _parse(by_name[r.ENGINE], patch)
        assert settings.internal_token == engine.events_token == expected, variant
        for container in by_name.values():
            assert not {"--internal-token", "--events-token"} & set(container["args"])
