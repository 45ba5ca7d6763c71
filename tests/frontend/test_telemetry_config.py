"""Tracing settings of ``mmis frontend`` / ``mmis engine``: flag, ``OTEL_*`` env, off by default."""

from __future__ import annotations

import argparse

import pytest

from mmis.config import ConfigError
from mmis.engine.builder import EngineStartError, engine_tracing
from mmis.engine.config import EngineConfig
from mmis.entrypoints import frontend as frontend_cli
from mmis.entrypoints import serve as serve_cli
from mmis.frontend.config import FrontendConfig
from mmis.frontend.state import frontend_tracing

OTEL = (
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_SERVICE_NAME",
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTEL:
        monkeypatch.delenv(name, raising=False)


def _frontend_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    frontend_cli.add_arguments(parser)
    return parser.parse_args(["--model", "m", *argv])


def test_tracing_is_off_without_an_endpoint() -> None:
    tracing = frontend_tracing(FrontendConfig(model="m"))
    assert not tracing.enabled and tracing.provider is None


def test_flag_and_env_turn_tracing_on_with_role_service_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = frontend_cli.settings_from(
        _frontend_args("--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces")
    )
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    tracing = frontend_tracing(settings)
    try:
        assert tracing.provider is not None
        assert tracing.provider.resource.attributes["service.name"] == "mmis-frontend"
        assert "0.25" in tracing.provider.sampler.get_description()
    finally:
        tracing.shutdown()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4318/v1/traces")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "pod-7")
    p1 = engine_tracing(EngineConfig())
    try:
        assert p1.provider is not None
        assert p1.provider.resource.attributes["service.name"] == "pod-7"
    finally:
        p1.shutdown()


def test_bad_tracing_settings_are_config_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="OTLP endpoint"):
        frontend_cli.settings_from(_frontend_args("--otlp-traces-endpoint", "ftp://collector"))
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "2")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    with pytest.raises(ConfigError, match="OTEL_TRACES_SAMPLER_ARG"):
        frontend_cli.settings_from(_frontend_args())
    with pytest.raises(EngineStartError, match="OTEL_TRACES_SAMPLER_ARG"):
        engine_tracing(EngineConfig())
    with pytest.raises(ConfigError, match="drift-window-s"):
        frontend_cli.settings_from(_frontend_args("--drift-window-s", "0"))


def test_serve_forwards_the_endpoint_to_its_engine() -> None:
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args(["--otlp-traces-endpoint", "http://c:4318/v1/traces"])
    cmd = serve_cli.engine_command(args, serve_cli.frontend_settings(args))
    assert cmd[cmd.index("--otlp-traces-endpoint") + 1] == "http://c:4318/v1/traces"
