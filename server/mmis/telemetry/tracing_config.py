"""Tracing settings: explicit values over the standard ``OTEL_*`` environment over defaults.

Tracing is OFF unless an OTLP traces endpoint is known (explicit ``otlp_traces_endpoint``,
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``), and it stays off
when ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``.

Variables read (names and meanings from the OpenTelemetry SDK environment specification):
``OTEL_SDK_DISABLED``, ``OTEL_SERVICE_NAME``, ``OTEL_TRACES_EXPORTER`` (``otlp`` | ``none``),
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (used as is), ``OTEL_EXPORTER_OTLP_ENDPOINT`` (a base:
``/v1/traces`` is appended for HTTP), ``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL`` (``grpc`` |
``http/protobuf``), ``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG``. Headers, TLS and
timeouts (``OTEL_EXPORTER_OTLP_*_HEADERS`` ...) are left to the exporters, which read them.

Invariant: every bad value raises :class:`TracingConfigError` naming the variable.
"""

from __future__ import annotations

import dataclasses
import math
import os
import urllib.parse
from collections.abc import Mapping

from mmis.telemetry.errors import TracingConfigError

PROTOCOLS = ("grpc", "http/protobuf")
_SAMPLERS = {
    "always_on": (1.0, False),
    "always_off": (0.0, False),
    "traceidratio": (None, False),
    "parentbased_always_on": (1.0, True),
    "parentbased_always_off": (0.0, True),
    "parentbased_traceidratio": (None, True),
}


@dataclasses.dataclass(frozen=True)
class TracingConfig:
    otlp_traces_endpoint: str | None = None
    protocol: str = "grpc"
    sampling_ratio: float = 1.0
    parent_based: bool = True  # follow the caller's sampling decision when there is one
    service_name: str = "mmis"
    disabled: bool = False  # OTEL_SDK_DISABLED / OTEL_TRACES_EXPORTER=none

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise TracingConfigError(f"OTLP protocol {self.protocol!r} is not one of {PROTOCOLS}")
        if not (math.isfinite(self.sampling_ratio) and 0.0 <= self.sampling_ratio <= 1.0):
            raise TracingConfigError(f"sampling ratio {self.sampling_ratio} is not in [0, 1]")
        if self.otlp_traces_endpoint is not None:
            _check_endpoint(self.otlp_traces_endpoint, self.protocol)

    @property
    def enabled(self) -> bool:
        return self.otlp_traces_endpoint is not None and not self.disabled

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        otlp_traces_endpoint: str | None = None,
        protocol: str | None = None,
        sampling_ratio: float | None = None,
        service_name: str | None = None,
    ) -> TracingConfig:
        env = os.environ if environ is None else environ

        def get(name: str) -> str | None:
            value = env.get(name, "").strip()
            return value or None

        disabled = _flag(get("OTEL_SDK_DISABLED"), "OTEL_SDK_DISABLED")
        exporter = (get("OTEL_TRACES_EXPORTER") or "otlp").lower()
        if exporter not in ("otlp", "none"):
            raise TracingConfigError(
                f"OTEL_TRACES_EXPORTER={exporter!r}: mmis exports otlp or none"
            )
        proto = (
            protocol
            or get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or cls.protocol
        )
        endpoint = otlp_traces_endpoint or get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        base = get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if endpoint is None and base is not None:
            endpoint = base.rstrip("/") + "/v1/traces" if proto == "http/protobuf" else base
        ratio, parent_based = _sampler(get("OTEL_TRACES_SAMPLER"), get("OTEL_TRACES_SAMPLER_ARG"))
        return cls(
            otlp_traces_endpoint=endpoint,
            protocol=proto,
            sampling_ratio=ratio if sampling_ratio is None else sampling_ratio,
            parent_based=parent_based,
            service_name=service_name or get("OTEL_SERVICE_NAME") or cls.service_name,
            disabled=disabled or exporter == "none",
        )


def _flag(raw: str | None, name: str) -> bool:
    if raw is None:
        return False
    low = raw.lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise TracingConfigError(f"{name}={raw!r} is not a boolean")


def _sampler(name: str | None, arg: str | None) -> tuple[float, bool]:
    key = (name or "parentbased_always_on").lower()
    if key not in _SAMPLERS:
        raise TracingConfigError(f"OTEL_TRACES_SAMPLER={name!r} is not one of {sorted(_SAMPLERS)}")
    ratio, parent_based = _SAMPLERS[key]
    if ratio is None:
        try:
            ratio = 1.0 if arg is None else float(arg)
        except ValueError as exc:
            raise TracingConfigError(f"OTEL_TRACES_SAMPLER_ARG={arg!r} is not a number") from exc
        if not (math.isfinite(ratio) and 0.0 <= ratio <= 1.0):
            raise TracingConfigError(f"OTEL_TRACES_SAMPLER_ARG={arg!r} is not in [0, 1]")
    return ratio, parent_based


def _check_endpoint(endpoint: str, protocol: str) -> None:
    if "://" not in endpoint and protocol == "grpc":
        endpoint = "http://" + endpoint  # grpc accepts a bare host:port
    parsed = urllib.parse.urlsplit(endpoint)
    try:
        bad_port = parsed.port == 0
    except ValueError:
        bad_port = True
    if bad_port:
        raise TracingConfigError(f"OTLP endpoint {endpoint!r} has a bad port")
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise TracingConfigError(
            f"OTLP endpoint {endpoint!r} must be http(s)://host[:port][/path]"
            + (" (or host:port for grpc)" if protocol == "grpc" else "")
        )
