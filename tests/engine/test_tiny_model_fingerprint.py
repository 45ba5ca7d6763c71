"""A cached tiny model built from another chat template is rebuilt on first use (the cache
fingerprint of ``mmis.tiny_models.tiny_model``); one with the current fingerprint is kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmis.tiny_models import tiny_model


def test_stale_cache_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMIS_MODEL_CACHE", str(tmp_path))
    builds: list[Path] = []

    def fake_build(out: Path, seed: int) -> None:  # the real builders take a minute
        builds.append(out)
        (out / "config.json").write_text("{}")

    monkeypatch.setitem(tiny_model.BUILDERS, "qwen2-vl", fake_build)
    stale = tmp_path / "mmis-tiny-qwen2-vl"
    stale.mkdir()
    (stale / "config.json").write_text('{"old": true}')  # no fingerprint: older code built it
    target = tiny_model.tiny_model_dir("qwen2-vl")
    assert target == stale and len(builds) == 1
    assert (target / "config.json").read_text() == "{}"
    stamp = (target / tiny_model.FINGERPRINT_FILE).read_text().strip()
    assert stamp == tiny_model.fingerprint("qwen2-vl") != tiny_model.fingerprint("llava")
    assert tiny_model.tiny_model_dir("qwen2-vl") == target and len(builds) == 1  # kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mmis-tiny-qwen2-vl"]  # no leftovers
