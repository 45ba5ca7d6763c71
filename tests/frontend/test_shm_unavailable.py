"""P0 starts without its SHM store when /dev/shm cannot hold it (frontend/state.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from mmis.frontend.config import FrontendConfig
from mmis.frontend.state import _shm_writer


def test_store_that_cannot_be_created_is_logged_and_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = FrontendConfig(mm_cache_type="shm", shm_gb=0.01, shm_dir=str(tmp_path / "gone"))
    with caplog.at_level(logging.ERROR, logger="mmis.frontend.state"):
        assert _shm_writer(settings) is None
    assert "shared-memory store not created" in caplog.text
    assert "--shm-gb" in caplog.text


def test_store_that_fits_is_made(tmp_path: Path) -> None:
    writer = _shm_writer(FrontendConfig(mm_cache_type="shm", shm_gb=0.01, shm_dir=str(tmp_path)))
    assert writer is not None
    try:
        assert writer.stats().capacity >= int(0.01 * 2**30)
        assert len(list(tmp_path.iterdir())) >= 1
    finally:
        writer.close()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("mmis-")]
