"""``--revision`` reaches every ``from_pretrained``, checked against a REAL hub cache layout.

A Hugging Face cache holds one repo id, ``acme/tiny``, with two commits: ``refs/main`` is the
tiny LLaVA, ``refs/v2`` the tiny Qwen2-VL whose config also says ``max_position_embeddings:
2048``. With ``HF_HUB_OFFLINE=1`` transformers resolves revisions from that cache exactly as it
does after a download. A child process parses the real command lines of ``mmis engine`` and
``mmis frontend`` and runs their loaders (``engine/builder.py`` ``load_model``,
``state.load_processor``): whichever ``from_pretrained`` missed the revision would load the
other family (model, tokenizer, processor) or the other context window (config).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mmis.tiny_models.tiny_model import tiny_model_dir

REPO = "acme/tiny"
MAIN_COMMIT = "a" * 40
V2_COMMIT = "b" * 40

CHILD = r"""
import argparse, json, sys
from mmis.engine.builder import load_model
from mmis.entrypoints import engine, frontend
from mmis.entrypoints.common import resolve_model
from mmis.frontend.state import load_processor

def parse(module, argv):
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)

def load(flags):
    cfg = engine.config_from_args(
        parse(engine, ["--model", "acme/tiny", "--device", "cpu", *flags]))
    adapter = load_model(cfg, resolve_model(cfg.model))
    settings = frontend.settings_from(parse(frontend, ["--model", "acme/tiny", *flags]))
    processor, max_len = load_processor(settings)
    return {
        "engine_family": adapter.family,
        "engine_max_len": adapter.text_config.max_position_embeddings,
        "tokenizer_has_qwen_image": "<|image_pad|>" in processor.processor.tokenizer.get_vocab(),
        "processor": type(processor.processor).__name__,
        "processor_image_token": processor.image_token,
        "frontend_max_len": max_len,
    }

print(json.dumps([load(flags) for flags in json.loads(sys.argv[1])]))
"""


def _snapshot(repo: Path, commit: str, source: Path, config_edit: dict[str, Any]) -> None:
    snap = repo / "snapshots" / commit
    shutil.copytree(source, snap)
    if config_edit:
        config = json.loads((snap / "config.json").read_text())
        config["text_config"].update(config_edit)
        (snap / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / ("models--" + REPO.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    _snapshot(repo, MAIN_COMMIT, tiny_model_dir("llava"), {})
    _snapshot(repo, V2_COMMIT, tiny_model_dir("qwen2-vl"), {"max_position_embeddings": 2048})
    (repo / "refs" / "main").write_text(MAIN_COMMIT)
    (repo / "refs" / "v2").write_text(V2_COMMIT)
    return cache


def load_with(hub_cache: Path, *runs: tuple[str, ...]) -> list[dict[str, Any]]:
    """Each run's flags through the loaders, in one child (one import of the stack); each
    load starts from the flags alone, so one run's revision cannot leak into the next."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MMIS_", "HF_"))}
    env.update(HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(runs)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


LLAVA = {
    "engine_family": "llava",
    "engine_max_len": 4096,
    "tokenizer_has_qwen_image": False,
    "processor": "LlavaProcessor",
    "processor_image_token": "<image>",
    "frontend_max_len": 4096,
}
QWEN_V2 = {
    "engine_family": "qwen2-vl",
    "engine_max_len": 2048,
    "tokenizer_has_qwen_image": True,
    "processor": "Qwen2VLProcessor",
    "processor_image_token": "<|image_pad|>",
    "frontend_max_len": 2048,
}


RUNS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "default": ((), LLAVA),  # no revision: the default branch
    "branch": (("--revision", "v2"), QWEN_V2),
    "commit": (("--revision", V2_COMMIT), QWEN_V2),  # a pinned commit
    "default-again": ((), LLAVA),  # after a v2 load: nothing of v2 stuck in the process
}


@pytest.fixture(scope="module")
def loaded(hub_cache: Path) -> dict[str, dict[str, Any]]:
    return dict(zip(RUNS, load_with(hub_cache, *(f for f, _ in RUNS.values())), strict=True))


@pytest.mark.parametrize("run", list(RUNS))
def test_every_load_follows_the_revision(loaded: dict[str, dict[str, Any]], run: str) -> None:
    assert loaded[run] == RUNS[run][1]
