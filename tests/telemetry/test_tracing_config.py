"""Tracing settings from the standard OTEL_* environment and explicit values."""

from __future__ import annotations

import pytest

from mmis.telemetry.errors import TracingConfigError
from mmis.telemetry.tracing_config import TracingConfig


def test_off_by_default_even_with_other_otel_variables() -> None:
    config = TracingConfig.from_env({"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"})
    assert not config.enabled
    assert not TracingConfig().enabled


def test_explicit_endpoint_beats_the_environment() -> None:
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://env:4317"}
    config = TracingConfig.from_env(env, otlp_traces_endpoint="http://cli:4317", sampling_ratio=0.5)
    assert config.enabled
    assert config.otlp_traces_endpoint == "http://cli:4317"
    assert config.sampling_ratio == 0.5


def test_traces_endpoint_is_used_as_is_and_the_base_endpoint_gets_the_http_path() -> None:
    as_is = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/custom",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    }
    assert TracingConfig.from_env(as_is).otlp_traces_endpoint == "http://c:4318/custom"
    base = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    }
    assert TracingConfig.from_env(base).otlp_traces_endpoint == "http://c:4318/v1/traces"
    grpc = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}
    config = TracingConfig.from_env(grpc)
    assert (config.protocol, config.otlp_traces_endpoint) == ("grpc", "http://c:4317")


def test_traces_protocol_beats_the_general_one() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
    }
    assert TracingConfig.from_env(env).protocol == "http/protobuf"


@pytest.mark.parametrize(
    ("sampler", "arg", "ratio", "parent_based"),
    [
        ("always_off", None, 0.0, False),
        ("traceidratio", "0.25", 0.25, False),
        ("parentbased_traceidratio", "0.1", 0.1, True),
        ("parentbased_always_on", None, 1.0, True),
    ],
)
def test_standard_samplers(sampler: str, arg: str | None, ratio: float, parent_based: bool) -> None:
    env = {"OTEL_TRACES_SAMPLER": sampler, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"}
    if arg is not None:
        env["OTEL_TRACES_SAMPLER_ARG"] = arg
    config = TracingConfig.from_env(env)
    assert (config.sampling_ratio, config.parent_based) == (ratio, parent_based)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"OTEL_SDK_DISABLED": "true"}, None),
        ({"OTEL_TRACES_EXPORTER": "none"}, None),
        ({"OTEL_SDK_DISABLED": "maybe"}, "OTEL_SDK_DISABLED"),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
        ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "half"}, "SAMPLER_ARG"),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, "SAMPLER_ARG"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "protocol"),
    ],
)
def test_disabling_and_bad_values(env: dict[str, str], match: str | None) -> None:
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317", **env}
    if match is None:
        assert not TracingConfig.from_env(env).enabled
    else:
        with pytest.raises(TracingConfigError, match=match):
            TracingConfig.from_env(env)


@pytest.mark.parametrize(
    ("endpoint", "protocol", "ok"),
    [
        ("collector:4317", "grpc", True),
        ("https://collector.example/otlp", "http/protobuf", True),
        ("collector:4318", "http/protobuf", False),
        ("ftp://collector:4317", "grpc", False),
        ("http://collector:99999", "grpc", False),
        ("http://:4317", "grpc", False),
    ],
)
def test_endpoint_validation(endpoint: str, protocol: str, ok: bool) -> None:
    if ok:
        assert TracingConfig(otlp_traces_endpoint=endpoint, protocol=protocol).enabled
    else:
        with pytest.raises(TracingConfigError, match="endpoint"):
            TracingConfig(otlp_traces_endpoint=endpoint, protocol=protocol)


def test_ratio_out_of_range_is_rejected() -> None:
    with pytest.raises(TracingConfigError, match="sampling ratio"):
        TracingConfig.from_env({}, sampling_ratio=1.5)
