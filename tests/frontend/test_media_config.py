"""FrontendConfig: secure defaults, env layer, typed errors naming the flag for bad values."""

from __future__ import annotations

import pytest

from mmis.config import ConfigError, from_env
from mmis.frontend.config import FrontendConfig


def test_defaults_are_secure() -> None:
    config = FrontendConfig()
    assert config.allowed_local_media_path is None
    assert config.allow_private_media_urls is False
    assert config.allowed_media_networks == ()


def test_environment_and_overrides() -> None:
    env = {
        "MMIS_FRONTEND_ALLOWED_LOCAL_MEDIA_PATH": "/data/images",
        "MMIS_FRONTEND_ALLOW_PRIVATE_MEDIA_URLS": "true",
        "MMIS_FRONTEND_ALLOWED_MEDIA_NETWORKS": "10.0.0.0/8,fd00::/8",
        "MMIS_FRONTEND_MEDIA_MAX_BYTES": "1024",
        "MMIS_FRONTEND_IMAGE_FORMATS": "PNG,JPEG",
    }
    config = from_env(FrontendConfig, "frontend", environ=env, max_images_per_prompt=3)
    assert config.allowed_local_media_path == "/data/images"
    assert config.allow_private_media_urls is True
    assert config.allowed_media_networks == ("10.0.0.0/8", "fd00::/8")
    assert config.media_max_bytes == 1024
    assert config.image_formats == ("PNG", "JPEG")
    assert config.max_images_per_prompt == 3


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"media_max_bytes": 0}, "--media-max-bytes"),
        ({"media_max_pixels": -1}, "--media-max-pixels"),
        ({"media_fetch_timeout_s": 0.0}, "--media-fetch-timeout-s"),
        ({"media_max_redirects": -1}, "--media-max-redirects"),
        ({"max_images_per_prompt": 0}, "--max-images-per-prompt"),
        ({"image_formats": ()}, "--image-formats"),
        ({"allowed_local_media_path": ""}, "--allowed-local-media-path"),
        ({"allowed_media_networks": ("10.0.0.0/33",)}, "--allowed-media-networks"),
    ],
)
def test_bad_values_raise_config_error(settings: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        FrontendConfig(**settings)  # type: ignore[arg-type]


def test_bad_environment_value_names_the_variable() -> None:
    env = {"MMIS_FRONTEND_MEDIA_MAX_BYTES": "lots"}
    with pytest.raises(ConfigError, match="MMIS_FRONTEND_MEDIA_MAX_BYTES"):
        from_env(FrontendConfig, "frontend", environ=env)
