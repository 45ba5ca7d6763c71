"""Issue 11's "medium LLaVA", random, for the engine benchmarks (``bench_engine_medium.py``).

A Llama text model of hidden 896, 14 heads (2 KV heads, head_dim 64), 6 layers, intermediate
2432, 4k positions; a CLIP tower 768 wide (2 layers, 224x224 images, patch 14: 256 image
tokens); the tiny LLaVA's tokenizer and chat template (``mmis.engine.tiny_model``).

Invariants:
- Deterministic (seed 0), built into a directory the caller names, never committed.
- Its greedy answers are printable text: the ``lm_head`` rows of the special tokens and of the
  byte tokens that are no text on their own (partial UTF-8) are zero, so they never win
  against the random logits of the others. A streaming server sends such bytes only once they
  form text, so without this a random answer may stream no content at all (no time to first
  token to measure). Speed and FLOPs are the same.
"""

from __future__ import annotations

from pathlib import Path


def build_medium_llava(out: Path) -> Path:
    """The medium random LLaVA (see the module docstring), written into ``out``; returns it."""
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

    from mmis.engine.tiny_model import build_tiny_model

    tiny = build_tiny_model(out.parent / f".{out.name}-tiny", "llava")
    base = AutoProcessor.from_pretrained(tiny)
    tokenizer = base.tokenizer
    image_size, patch = 224, 14
    vision = CLIPVisionConfig(
        hidden_size=768,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=12,
        image_size=image_size,
        patch_size=patch,
        projection_dim=768,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=896,
        intermediate_size=2432,
        num_hidden_layers=6,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
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
        vision_feature_layer=-1,
    )
    config.bos_token_id, config.eos_token_id = text.bos_token_id, text.eos_token_id
    config.pad_token_id = text.pad_token_id
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": image_size},
            crop_size={"height": image_size, "width": image_size},
        ),
        tokenizer=tokenizer,
        patch_size=patch,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=base.chat_template,
    )
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    silent = [
        i
        for i in range(len(tokenizer))
        if i in tokenizer.all_special_ids
        or "\ufffd" in tokenizer.decode([i])
        or not tokenizer.decode([i]).strip()
    ]
    with torch.no_grad():
        model.lm_head.weight[silent] = 0
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id = text.eos_token_id, text.pad_token_id
    gen.do_sample = False
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out
