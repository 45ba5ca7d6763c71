"""P0 front-end settings: media loading limits, the SSRF switch, request limits.

Build it with ``mmis.config.from_env(FrontendConfig, "frontend", **cli_overrides)``;
each field reads ``MMIS_FRONTEND_<FIELD>`` (e.g. ``MMIS_FRONTEND_ALLOWED_LOCAL_MEDIA_PATH``,
the ``--allowed-local-media-path`` flag).

Invariants:
- Secure by default: ``file://`` media is disabled (no root) and remote URLs that resolve to
  private, loopback, link-local, multicast or reserved addresses are refused.
- Every limit is positive; a bad value raises :class:`~mmis.config.ConfigError` at
  construction, naming the field.
"""

from __future__ import annotations

import dataclasses
import ipaddress

from mmis.config import ConfigError

MiB = 1 << 20

# Formats PIL may open. Deliberately short: no EPS/PS (Ghostscript), no exotic decoders.
DEFAULT_IMAGE_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


@dataclasses.dataclass(frozen=True)
class FrontendConfig:
    # local files: None disables file:// URLs entirely
    allowed_local_media_path: str | None = None
    # SSRF guard: True allows URLs that resolve to private/loopback/... addresses (tests, labs)
    allow_private_media_urls: bool = False
    # CIDRs exempt from the SSRF guard (e.g. an internal media server), all others still vetted
    allowed_media_networks: tuple[str, ...] = ()
    # bytes of one encoded image, whatever its source (data:, http(s)://, file://)
    media_max_bytes: int = 20 * MiB
    # width * height, checked from the header before any pixel is decoded
    media_max_pixels: int = 25_000_000
    media_connect_timeout_s: float = 5.0
    media_read_timeout_s: float = 10.0
    # wall-clock budget of one remote fetch, all redirects included (stops slow trickles)
    media_fetch_timeout_s: float = 30.0
    media_max_redirects: int = 5
    max_images_per_prompt: int = 8
    image_formats: tuple[str, ...] = DEFAULT_IMAGE_FORMATS
    # the largest accepted ``n`` (choices per request)
    max_n: int = 16

    def __post_init__(self) -> None:
        positive = {
            "media_max_bytes": self.media_max_bytes,
            "media_max_pixels": self.media_max_pixels,
            "media_connect_timeout_s": self.media_connect_timeout_s,
            "media_read_timeout_s": self.media_read_timeout_s,
            "media_fetch_timeout_s": self.media_fetch_timeout_s,
            "max_images_per_prompt": self.max_images_per_prompt,
            "max_n": self.max_n,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ConfigError(f"FrontendConfig.{name} must be > 0, got {value!r}")
        if self.media_max_redirects < 0:
            raise ConfigError(
                f"FrontendConfig.media_max_redirects must be >= 0, got {self.media_max_redirects}"
            )
        if not self.image_formats:
            raise ConfigError("FrontendConfig.image_formats must name at least one format")
        for cidr in self.allowed_media_networks:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError as exc:
                raise ConfigError(
                    f"FrontendConfig.allowed_media_networks: {cidr!r} is not a network ({exc})"
                ) from exc
        if self.allowed_local_media_path == "":
            raise ConfigError(
                "FrontendConfig.allowed_local_media_path is empty; omit it to disable file:// URLs"
            )
