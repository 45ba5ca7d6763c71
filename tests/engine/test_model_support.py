"""What the engine refuses to run because it could not run it exactly (``engine/execution/model/``).

Real checkpoints (the tiny families, rewritten where a case needs another config) through
the real loader: sliding-window attention and other layer types, a decoder layer without its
own ``layer_idx``, an unknown family. Each is refused at load time with a message naming
what, never served with full attention or another layer's KV cache.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from mmis.engine.execution.model import UnsupportedModelError, load_adapter
from mmis.engine.execution.model.adapter import check_exact
from mmis.entrypoints.common import TINY_MODELS
from mmis.tiny_models.tiny_model import FAMILIES, MODELS

pytestmark = [pytest.mark.model]


def _variant(src: Path, dst: Path, **text: Any) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["text_config"].update(text)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_sliding_window_attention_is_refused(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    windowed = _variant(
        tiny_dirs["qwen2-vl"],
        tmp_path / "windowed",
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=0,
        layer_types=None,
    )
    with pytest.raises(UnsupportedModelError, match="sliding"):
        load_adapter(windowed, "cpu")


def test_other_layer_types_are_refused(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    mixed = _variant(
        tiny_dirs["qwen2-vl"],
        tmp_path / "mixed",
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=8,
    )
    with pytest.raises(UnsupportedModelError, match="sliding_attention"):
        load_adapter(mixed, "cpu")


def test_a_layer_without_its_own_layer_idx_is_refused(tiny_dirs: dict[str, Path]) -> None:
    adapter = load_adapter(tiny_dirs["llava"], "cpu")
    layers = adapter.language_model.layers
    check_exact(adapter.text_config, adapter.language_model)  # as loaded: fine
    layers[1].self_attn.layer_idx = 0  # would read and write layer 0's KV cache
    with pytest.raises(UnsupportedModelError, match="decoder layer 1"):
        check_exact(adapter.text_config, adapter.language_model)
    del layers[1].self_attn.layer_idx
    with pytest.raises(UnsupportedModelError, match="layer_idx None"):
        check_exact(adapter.text_config, adapter.language_model)


def test_an_unknown_family_is_refused_naming_the_known_ones(
    tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    other = tmp_path / "other"
    shutil.copytree(tiny_dirs["llava"], other)
    config = json.loads((other / "config.json").read_text())
    config["model_type"] = "paligemma"
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedModelError, match=r"'paligemma' is not supported; known: .*llava"
    ):
        load_adapter(other, "cpu")


def test_every_tiny_family_has_a_built_in_name() -> None:
    assert set(TINY_MODELS.values()) == set(MODELS) >= set(FAMILIES)
    assert {f"mmis-tiny-{f}" for f in FAMILIES} <= set(TINY_MODELS)
