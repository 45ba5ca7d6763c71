"""Random LLaVA models for the engine benchmarks and the device check: issue 11's "medium
LLaVA" (``bench_engine_medium.py``) and the LLaVA-1.5-7B shape (``scripts/gpu-check``).

    .venv/bin/python benchmarks/medium_llava.py OUT [--shape medium|llava-1.5-7b|llava-1.5-7b-mini]
        [--device cpu|cuda] [--dtype float32|bfloat16]

Shapes (``SHAPES``):

- ``medium``: a Llama text model of hidden 896, 14 heads (2 KV heads, head_dim 64), 6 layers,
  intermediate 2432, 4k positions; a CLIP tower 768 wide (2 layers, 224x224 images, patch 14:
  256 image tokens, last layer's features);
- ``llava-1.5-7b``: LLaVA-1.5-7B's shape: Llama-2-7B text (hidden 4096, 32 layers, 32 heads of
  128 with as many KV heads, intermediate 11008, vocab 32064, 4k positions) and CLIP
  ViT-L/14 at 336 px (1024 wide, 24 layers, 16 heads, intermediate 4096; the second-to-last
  layer's features, CLS dropped: 576 image tokens); 7.1 B parameters, 14 GB in bfloat16.
  Built on the GPU (``--device cuda --dtype bfloat16``: ``from_config`` under
  ``torch.device("cuda")``, ~25 s with the save into ``/dev/shm``);
- ``llava-1.5-7b-mini``: the same family and geometry at CPU size (text hidden 256, 2 layers,
  4 heads of 64, vocab 32064; tower 128 wide, 2 layers, 336 px, 576 image tokens), for
  ``scripts/gpu-check run --dry-run``: the 7B's code paths in seconds.

Every shape uses the tiny LLaVA's tokenizer and chat template (``mmis.tiny_models.tiny_model``).

Invariants:
- Deterministic (seed 0), built into a directory the caller names, never committed. The
  directory is written under a temporary name and renamed into place: it holds a whole model
  or none; the command line reuses a directory that already holds one.
- Its greedy answers are printable text: the ``lm_head`` rows of the special tokens, of the
  byte tokens that are no text on their own (partial UTF-8) and of the ids past the tokenizer
  (a vocabulary padded to 32064) are zero, so they never win against the random logits of
  the others. A streaming server sends such bytes only once they form text, so without this
  a random answer may stream no content at all (no time to first token to measure). Speed and
  FLOPs are the same.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

# per shape: the text model's and the vision tower's settings, the image size and which
# tower layer feeds the projector
SHAPES: dict[str, dict[str, Any]] = {
    "medium": {
        "text": {
            "hidden_size": 896,
            "intermediate_size": 2432,
            "num_hidden_layers": 6,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "head_dim": 64,
        },
        "vision": {
            "hidden_size": 768,
            "intermediate_size": 1536,
            "num_hidden_layers": 2,
            "num_attention_heads": 12,
            "projection_dim": 768,
        },
        "vocab_size": None,  # the tokenizer's
        "image_size": 224,
        "feature_layer": -1,
    },
    "llava-1.5-7b": {
        "text": {
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "head_dim": 128,
        },
        "vision": {
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "projection_dim": 768,
        },
        "vocab_size": 32064,
        "image_size": 336,
        "feature_layer": -2,
    },
    "llava-1.5-7b-mini": {
        "text": {
            "hidden_size": 256,
            "intermediate_size": 688,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 64,
        },
        "vision": {
            "hidden_size": 128,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "projection_dim": 128,
        },
        "vocab_size": 32064,
        "image_size": 336,
        "feature_layer": -2,
    },
}
PATCH = 14


def build_llava(out: Path, shape: str = "medium", device: str = "cpu", dtype: Any = None) -> Path:
    """The random LLaVA of ``shape`` (see the module docstring), built on ``device`` in
    ``dtype`` (default float32) and written into ``out``, which must not hold a model yet;
    returns ``out``."""
    import torch
    from transformers import (
        AutoModelForImageTextToText,
        AutoProcessor,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaProcessor,
    )

    from mmis.tiny_models.tiny_model import build_tiny_model

    spec = SHAPES[shape]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.parent / f".{out.name}.building"
    shutil.rmtree(work, ignore_errors=True)
    tiny = build_tiny_model(work / "tiny", "llava")
    base = AutoProcessor.from_pretrained(tiny)
    tokenizer = base.tokenizer
    image_size = spec["image_size"]
    vision = CLIPVisionConfig(**spec["vision"], image_size=image_size, patch_size=PATCH)
    text = LlamaConfig(
        **spec["text"],
        vocab_size=spec["vocab_size"] or len(tokenizer),
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=int(tokenizer.convert_tokens_to_ids("<image>")),
        vision_feature_select_strategy="default",
        vision_feature_layer=spec["feature_layer"],
    )
    config.bos_token_id, config.eos_token_id = text.bos_token_id, text.eos_token_id
    config.pad_token_id = text.pad_token_id
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": image_size},
            crop_size={"height": image_size, "width": image_size},
        ),
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=base.chat_template,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype or torch.float32)
    silent = [
        i
        for i in range(len(tokenizer))
        if i in tokenizer.all_special_ids
        or "\ufffd" in tokenizer.decode([i])
        or not tokenizer.decode([i]).strip()
    ]
    with torch.no_grad():
        model.lm_head.weight[silent] = 0
        model.lm_head.weight[len(tokenizer) :] = 0  # ids no token has (a padded vocabulary)
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id = text.eos_token_id, text.pad_token_id
    gen.do_sample = False
    target = work / "model"
    model.save_pretrained(target)
    processor.save_pretrained(target)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    target.rename(out)
    shutil.rmtree(work, ignore_errors=True)
    return out


def build_medium_llava(out: Path) -> Path:
    """The medium random LLaVA (see the module docstring), written into ``out``; returns it."""
    return build_llava(out, "medium")


def describe(model_dir: Path) -> tuple[int, int, str]:
    """``(parameters, bytes, dtype)`` of the weights saved in ``model_dir`` (safetensors
    headers; the dtype of the first tensor)."""
    import json
    import struct

    params = size = 0
    dtype = "?"
    for path in sorted(model_dir.glob("*.safetensors")):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = entry["dtype"] if dtype == "?" else dtype
            count = 1
            for dim in entry["shape"]:
                count *= dim
            params += count
            size += entry["data_offsets"][1] - entry["data_offsets"][0]
    return params, size, dtype


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="model directory (reused if it holds one)")
    parser.add_argument("--shape", default="medium", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    import torch

    start = time.perf_counter()
    reused = (args.out / "config.json").exists()
    if not reused:
        build_llava(args.out, args.shape, args.device, getattr(torch, args.dtype))
    seconds = time.perf_counter() - start
    params, size, dtype = describe(args.out)
    how = "reused" if reused else f"built on {args.device} in {seconds:.1f} s"
    print(f"{args.shape}: {params / 1e9:.2f} B parameters, {size / 1e9:.2f} GB in {args.out}")
    print(
        f"SUMMARY model: {args.shape} {params / 1e9:.2f} B params {dtype} "
        f"{size / 1e9:.2f} GB, {how}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
