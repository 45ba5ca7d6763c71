"""The operator's encoder pods (``spec.encoder``) against the real ``mmis encoder`` command
line: what the operator writes is what the encoder runs with, and it meets the front ends the
operator wires to it.

- The encoder container's command parses with the real parser (an unknown flag fails), into
  the encoder's own config: the engine's model string and revision (the encoder's key must
  equal what P0 asks and P1's), no dtype of its own (the server's ``auto``, as P1), the ROUTER
  on every interface at the container's named port, the health port the probes use.
- Off loopback the encoder refuses to start without a token: the pod's token (from the
  internal token's Secret) passes that check; every ``MMIS_*`` variable of the container is
  one the encoder reads.
- The front end's ``--encoder-service`` names the encoders' headless Service and its port.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from mmis.cli import COMMANDS
from mmis.engine.encoder.config import EncoderConfig
from mmis.entrypoints import encoder as encoder_cli
from mmis.entrypoints import frontend as frontend_cli
from mmis_operator import builders, encoder
from mmis_operator import kube as r
from mmis_operator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
SECRET_VALUE = "from-secret"  # stands in for the secretKeyRef the kubelet resolves
BASE = yaml.safe_load((ROOT / "examples" / "llava-encoder.yaml").read_text())
VARIANTS: dict[str, dict[str, Any]] = {
    "example": {},
    "revision-otlp": {
        "model": {"id": "acme/vlm", "revision": "v1.2-rc"},
        "telemetry": {"otlpEndpoint": "http://otel:4317"},
    },
    "path-cpu": {"model": {"path": "/models/x"}, "resources": {"gpus": 0, "memory": "8Gi"}},
}
READ_ENV = {f"MMIS_ENCODER_{f.name.upper()}" for f in dataclasses.fields(EncoderConfig)}


def _resource(variant: str) -> dict[str, Any]:
    obj = copy.deepcopy(BASE)
    obj["metadata"].update(namespace="ns", uid="u")
    obj["spec"].update(VARIANTS[variant])
    return obj


def _parse(
    container: dict[str, Any], monkeypatch: pytest.MonkeyPatch, module: Any
) -> argparse.Namespace:
    argv = [*container["command"], *container["args"]]
    assert argv[0] == "mmis" and not any("$(" in a for a in argv), argv
    assert importlib.import_module(COMMANDS[argv[1]][0]) is module, argv[1]
    for key in list(os.environ):
        if key.startswith(("MMIS_", "OTEL_")):
            monkeypatch.delenv(key)
    for item in container.get("env", []):
        if "value" in item:
            monkeypatch.setenv(item["name"], str(item["value"]))
        elif "secretKeyRef" in item.get("valueFrom", {}):
            monkeypatch.setenv(item["name"], SECRET_VALUE)
    parser = argparse.ArgumentParser(prog=f"mmis {argv[1]}", exit_on_error=False)
    module.add_arguments(parser)
    return parser.parse_args(argv[2:])  # an unknown flag raises: the test fails


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_encoder_runs_what_the_operator_writes(
    variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    obj = _resource(variant)
    spec = parse_spec(obj["spec"])
    assert spec.encoder is not None
    dep = encoder.deployment(obj, spec, spec.encoder)
    (box,) = dep["spec"]["template"]["spec"]["containers"]
    with monkeypatch.context() as patch:
        cfg = encoder_cli.config_from_args(_parse(box, patch, encoder_cli))
        encoder_cli.check_endpoints(cfg)  # off loopback: passes only with the token
    assert cfg.token == SECRET_VALUE
    assert {e["name"] for e in box["env"] if e["name"].startswith("MMIS_")} <= READ_ENV
    # the key: the engine's model string and revision, the dtype P1 resolves (auto)
    engine = builders.engine_args(spec)
    assert cfg.model == spec.model.name == engine[engine.index("--model") + 1]
    assert cfg.revision == spec.model.revision
    assert "--dtype" not in box["args"] and "--dtype" not in engine
    # the ROUTER on every interface, at the container's named port; health where probes go
    ports = {p["name"]: p["containerPort"] for p in box["ports"]}
    assert cfg.endpoint == f"tcp://0.0.0.0:{ports[r.ENCODER_PORT_NAME]}"
    assert cfg.health_port == ports[r.ENCODER_HEALTH_PORT_NAME]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert box[probe]["httpGet"] == {"path": "/health", "port": r.ENCODER_HEALTH_PORT_NAME}
    assert cfg.otlp_traces_endpoint == spec.otlp_endpoint


def test_the_front_end_asks_the_encoders_service(monkeypatch: pytest.MonkeyPatch) -> None:
    obj = _resource("example")
    spec = parse_spec(obj["spec"])
    pod = builders.deployment(obj, spec)["spec"]["template"]["spec"]
    (front,) = [c for c in pod["containers"] if c["name"] == r.FRONTEND]
    with monkeypatch.context() as patch:
        settings = frontend_cli.settings_from(_parse(front, patch, frontend_cli))
    service = encoder.service(obj)
    host, port = str(settings.encoder_service).rsplit(":", 1)
    assert host == f"{service['metadata']['name']}.ns.svc"
    assert int(port) == service["spec"]["ports"][0]["port"] == r.ENCODER_PORT
    assert service["spec"]["clusterIP"] == "None"  # every A record is one encoder


def test_the_encoder_autoscaler_reads_a_metric_the_encoder_exports() -> None:
    from mmis.telemetry import catalog
    from mmis_operator import spec as operator_spec

    assert operator_spec.ENCODER_QUEUE in catalog.BY_NAME
    assert catalog.BY_NAME[operator_spec.ENCODER_QUEUE].owner is catalog.Owner.ENCODER
