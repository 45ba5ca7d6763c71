"""The tiny models: plain-transformers loadable, image-dependent, deterministic, atomic."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmis.cli import main as cli_main
from mmis.tiny_models.tiny_model import (
    FAMILIES,
    TinyModelError,
    build_tiny_model,
    default_model_dir,
    model_cache_dir,
)

pytestmark = pytest.mark.model


def _image(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8))


@pytest.mark.parametrize("name", FAMILIES)
def test_loads_with_plain_transformers_and_output_depends_on_image(tiny_dirs, name):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = tiny_dirs[name]
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = processor.tokenizer
    assert 400 <= len(tokenizer) <= 500
    assert processor.image_token in tokenizer.get_vocab()
    assert model.config.get_text_config().eos_token_id < len(tokenizer)
    assert sum(f.stat().st_size for f in path.glob("*.safetensors")) < 4 * 2**20

    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}
    ]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    outputs = []
    for seed in (1, 2):
        inputs = processor(text=[prompt], images=[_image(seed)], return_tensors="pt")
        image_tokens = int((inputs["input_ids"] == model.config.image_token_id).sum())
        assert image_tokens > 1  # the processor expanded the image marker
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=[])
        outputs.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    assert len(outputs[0]) == 8
    assert outputs[0] != outputs[1], "the generated text must depend on the image"


def test_llava_chat_template_renders_turns_and_images(tiny_dirs):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_dirs["llava"])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert text == "Be brief.\nUSER: <image>\nHi\nASSISTANT: Hello\nUSER: Bye\nASSISTANT:"


def test_build_is_deterministic(tmp_path: Path):
    first = build_tiny_model(tmp_path / "a", "qwen2-vl")
    second = build_tiny_model(tmp_path / "b", "qwen2-vl")
    other_seed = build_tiny_model(tmp_path / "c", "qwen2-vl", seed=1)

    def digest(path: Path) -> str:
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()

    assert digest(first) == digest(second)
    assert digest(first) != digest(other_seed)
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    # readable by others (a pod's uid 1000 serves what root built); safetensors alone
    # writes the weights 0600
    umask = os.umask(0)
    os.umask(umask)
    assert {(p.name, p.stat().st_mode & 0o777) for p in first.iterdir()} == {
        (p.name, 0o666 & ~umask) for p in first.iterdir()
    }


def test_refuses_unknown_family_and_non_empty_directory(tmp_path: Path):
    with pytest.raises(TinyModelError, match="unknown model family"):
        build_tiny_model(tmp_path / "x", "gpt-2")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(TinyModelError, match="not empty"):
        build_tiny_model(tmp_path / "full", "llava")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


def test_cli_writes_a_model(tmp_path: Path, capsys):
    assert cli_main(["tiny-model", str(tmp_path / "m"), "--family", "qwen2-vl"]) == 0
    assert (tmp_path / "m" / "config.json").is_file()
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    assert cli_main(["tiny-model", str(tmp_path / "m")]) == 2  # refuses to overwrite


_FIRST_USE = """
import sys
from mmis.tiny_models.tiny_model import default_model_dir
print("ready", flush=True)
sys.stdin.readline()  # the barrier: wait until the parent says go
print(default_model_dir(), flush=True)
"""


@pytest.mark.slow
def test_default_model_first_use_is_atomic_under_concurrency(tmp_path: Path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("MMIS_MODEL_CACHE", str(cache))
    assert model_cache_dir() == cache
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _FIRST_USE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for proc in procs:  # both imported everything and wait
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    for proc in procs:  # release both at once
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    outputs = [proc.communicate(timeout=300)[0].strip() for proc in procs]
    target = cache / "mmis-tiny-llava"
    assert [p.returncode for p in procs] == [0, 0]
    assert outputs == [str(target), str(target)]
    assert sorted(p.name for p in cache.iterdir()) == ["mmis-tiny-llava"]  # no temp leftovers
    from transformers import AutoModelForImageTextToText

    AutoModelForImageTextToText.from_pretrained(target)  # complete and loadable
    assert default_model_dir() == target  # cached: no rebuild
