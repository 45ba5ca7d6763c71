"""P0's settings: the one frozen :class:`FrontendConfig` of ``mmis frontend``.

Every field is a ``mmis frontend`` flag (``--field-name``) and a ``MMIS_FRONTEND_<FIELD>``
variable (e.g. ``MMIS_FRONTEND_ALLOWED_LOCAL_MEDIA_PATH``), both derived from the field by
``mmis.config``; build it with ``mmis.config.from_env(FrontendConfig, "frontend", **flags)``.

Invariants:
- Each setting has its one default and help here (settings P1 must agree on come from the
  shared definitions of ``mmis.config``).
- Secure by default: ``file://`` media is disabled (no root) and remote URLs that resolve to
  private, loopback, link-local, multicast or reserved addresses are refused.
- Every limit is positive; a bad value raises :class:`~mmis.config.ConfigError` at
  construction, naming the CLI flag.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Mapping
from typing import Any

from mmis.config import ConfigError, flag_of, setting, shared
from mmis.multimodal.hashing import DEFAULT_ALGORITHM, HASH_ALGORITHMS

MiB = 1 << 20

# Formats PIL may open. Deliberately short: no EPS/PS (Ghostscript), no exotic decoders.
DEFAULT_IMAGE_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# arguments of the processor call that mmis sets itself (ModelProcessor.process_image)
PROCESSOR_CALL_ARGS = frozenset({"text", "images", "return_tensors"})
_POSITIVE = (
    "engine_timeout_s",
    "ping_interval_s",
    "liveness_timeout_s",
    "drift_window_s",
    "stats_interval_s",
    "media_max_bytes",
    "media_max_pixels",
    "media_connect_timeout_s",
    "media_read_timeout_s",
    "media_fetch_timeout_s",
    "max_images_per_prompt",
    "max_n",
)


@dataclasses.dataclass(frozen=True)
class FrontendConfig:
    # the model and what clients see of it
    model: str = setting(
        "", help="model directory or id (processor and config); required (mmis serve: P1's default)"
    )
    revision: str | None = shared("revision")
    processor_kwargs: Mapping[str, Any] = setting(
        factory=dict,
        metavar="JSON",
        help="JSON object of keyword arguments for the model's processor call, "
        """e.g. '{"do_normalize": false}'; part of every image's mm_hash""",
    )
    served_model_name: str | None = setting(
        None, help="model name shown to clients (default: --model)"
    )
    # serving
    host: str = setting("127.0.0.1", help="address to bind")
    port: int = setting(8000, help="port to bind; 0 picks a free one")
    api_key: str | None = setting(None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    graceful_shutdown_s: float = setting(30.0, help="how long SIGTERM waits for in-flight requests")
    max_model_len: int | None = shared("max_model_len")
    # the engine (P1) and the multimodal cache mirrored with it
    engine_input_address: str = shared("engine_input_address")
    engine_output_address: str = shared("engine_output_address")
    client_index: int = setting(0, help="this P0's index among P1's clients (its output topic)")
    engine_timeout_s: float = setting(120.0, help="how long to wait for P1's handshake at start")
    ping_interval_s: float = setting(2.0, help="how often P1 is pinged")
    liveness_timeout_s: float = setting(10.0, help="P1 is dead after this long without a pong")
    mm_cache_type: str = shared("mm_cache_type")
    mm_cache_gb: float = shared("mm_cache_gb")
    shm_dir: str = shared("shm_dir")
    shm_gb: float = setting(1.0, help="size of the shared-memory store in GiB (shm)")
    hash_algorithm: str = setting(
        DEFAULT_ALGORITHM, choices=HASH_ALGORITHMS, help="mm_hash algorithm"
    )
    # telemetry
    otlp_traces_endpoint: str | None = shared("otlp_traces_endpoint")
    drift_window_s: float = setting(
        300.0, help="window of the drift rate on /metrics and /stats/cache"
    )
    stats_interval_s: float = setting(1.0, help="how often P1's figures are polled for /metrics")
    log_level: str = shared("log_level")
    # media
    allowed_local_media_path: str | None = setting(
        None, help="root under which file:// images may be read (unset: file:// is refused)"
    )
    allow_private_media_urls: bool = setting(
        False,
        flags=("--allow-private-media-urls", "--allow-private-media"),
        help="allow image URLs on private/loopback/link-local addresses (tests, labs)",
    )
    allowed_media_networks: tuple[str, ...] = setting(
        (), metavar="CIDR,...", help="networks exempt from the private-address check"
    )
    media_max_bytes: int = setting(20 * MiB, help="largest encoded image in bytes, any source")
    media_max_pixels: int = setting(
        25_000_000, help="largest image in pixels (width * height), checked before decoding"
    )
    media_connect_timeout_s: float = setting(5.0, help="connect timeout of an image fetch")
    media_read_timeout_s: float = setting(10.0, help="read timeout of an image fetch")
    media_fetch_timeout_s: float = setting(
        30.0, help="wall-clock budget of one image fetch, redirects included"
    )
    media_max_redirects: int = setting(5, help="most redirects one image fetch follows")
    max_images_per_prompt: int = setting(8, help="most images in one request")
    image_formats: tuple[str, ...] = setting(
        DEFAULT_IMAGE_FORMATS, metavar="FORMAT,...", help="image formats PIL may open"
    )
    max_n: int = setting(16, help="largest accepted n (choices per request)")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def __post_init__(self) -> None:
        def flag(name: str) -> str:
            return flag_of(FrontendConfig, name)

        for name in _POSITIVE:
            if not getattr(self, name) > 0:
                raise ConfigError(f"{flag(name)} must be > 0, got {getattr(self, name)!r}")
        for name in ("media_max_redirects", "mm_cache_gb", "client_index"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{flag(name)} must be >= 0, got {getattr(self, name)!r}")
        if self.mm_cache_type not in ("lru", "shm"):
            raise ConfigError(
                f"{flag('mm_cache_type')} must be lru or shm, got {self.mm_cache_type!r}"
            )
        reserved = sorted(PROCESSOR_CALL_ARGS & set(self.processor_kwargs))
        if reserved:
            raise ConfigError(
                f"{flag('processor_kwargs')} must not set {reserved}: mmis passes them itself"
            )
        if not self.image_formats:
            raise ConfigError(f"{flag('image_formats')} must name at least one format")
        for cidr in self.allowed_media_networks:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError as exc:
                raise ConfigError(
                    f"{flag('allowed_media_networks')}: {cidr!r} is not a network ({exc})"
                ) from exc
        if self.allowed_local_media_path == "":
            raise ConfigError(
                f"{flag('allowed_local_media_path')} is empty; omit it to disable file:// URLs"
            )
