"""Tiny LLaVA-NeXT and LLaVA-OneVision models (any-resolution tiles), built offline for tests.

What is real: the model and processor classes (``LlavaNextForConditionalGeneration`` with
``LlavaNextProcessor`` / ``LlavaNextImageProcessor``; ``LlavaOnevisionForConditionalGeneration``
with ``LlavaOnevisionProcessor`` / ``LlavaOnevisionImageProcessor``), so the tiling is the
families' own: the best-fitting ``image_grid_pinpoints`` resolution, a base tile of the whole
image plus the grid tiles, unpadding of the grid features to the image's aspect ratio, one
``image_newline`` row per feature row, and for OneVision the ``anyres_max_9`` cap (grid
features bilinearly shrunk when they exceed 9 tiles' worth) and multi-image prompts taking one
square-padded tile per image. The towers and language models are the hub checkpoints' kinds:
LLaVA-NeXT (llava-v1.6) a CLIP tower with CLS (strategy ``"default"``, features of layer -2)
and a Llama model; OneVision a SigLIP tower without CLS (``"full"``, layer -1) and a Qwen2
model.

What is scaled down: a 32 px base tile with 8 px patches (16 features per tile; the hub's
336/14 and 384/14), and the pinpoints scaled with it: LLaVA-NeXT's five (1x2, 2x1, 2x2, 3x1,
1x3 tiles) and OneVision's 6x6 grid of multiples of the tile, at 32 px instead of 336/384 px.
Two-layer towers and language models with 32/64-wide hidden states, a byte-level BPE of a few
hundred tokens, random weights (deterministic per seed). Both use the LLaVA chat template
(``USER: <image>\\n... ASSISTANT:``), not the hub checkpoints' own.

Invariants: as :mod:`mmis.tiny_models.tiny_model` (deterministic, self-contained, a few MB);
:data:`TEMPLATE` carries this builder's revision in a Jinja comment, so a builder change
reaches cached models through the fingerprint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmis.tiny_models.tiny_tokenizer import (
    LLAVA_SPECIALS,
    LLAVA_TEMPLATE,
    token_ids,
    train_tokenizer,
)

REVISION = 1
TEMPLATE = f"{{# mmis tiny llava-next/onevision r{REVISION} #}}" + LLAVA_TEMPLATE

TILE, PATCH = 32, 8
# llava-v1.6's pinpoints ([[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]) in tiles
NEXT_PINPOINTS = [[TILE * h, TILE * w] for h, w in ((1, 2), (2, 1), (2, 2), (3, 1), (1, 3))]
# OneVision's: every h x w grid of 1..6 tiles
ONEVISION_PINPOINTS = [[TILE * h, TILE * w] for h in range(1, 7) for w in range(1, 7)]
VISION_ASPECT_RATIO = "anyres_max_9"
FAMILIES = ("llava-next", "llava-onevision")


def _tokenizer(onevision: bool) -> Any:
    from transformers import PreTrainedTokenizerFast

    specials = [*LLAVA_SPECIALS, "<video>"] if onevision else list(LLAVA_SPECIALS)
    extra = {"image_token": "<image>"}
    if onevision:
        extra["video_token"] = "<video>"
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(specials, 448),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens=extra,
    )
    tokenizer.chat_template = TEMPLATE
    return tokenizer, token_ids(tokenizer, specials)


def _text_config(onevision: bool, vocab: int, ids: dict[str, int]) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    common: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "bos_token_id": ids["<s>"],
        "eos_token_id": ids["</s>"],
        "pad_token_id": ids["<pad>"],
        "initializer_range": 0.2,
    }
    return Qwen2Config(**common) if onevision else LlamaConfig(**common)


def build(out: Path, seed: int, family: str) -> None:
    """Write the tiny ``family`` ("llava-next" or "llava-onevision") into ``out``."""
    if family not in FAMILIES:
        raise ValueError(f"tiny_llava_next builds {FAMILIES}, not {family!r}")
    import torch
    from transformers import (
        AutoModelForImageTextToText,
        CLIPVisionConfig,
        LlavaNextConfig,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
        LlavaOnevisionConfig,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
        SiglipVisionConfig,
    )

    from mmis.tiny_models.tiny_model import _save

    onevision = family == "llava-onevision"
    tokenizer, ids = _tokenizer(onevision)
    tower: dict[str, Any] = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": TILE,
        "patch_size": PATCH,
    }
    text = _text_config(onevision, len(tokenizer), ids)
    extra: dict[str, Any] = {"initializer_range": 0.2}
    config: Any
    processor: Any
    if onevision:
        config = LlavaOnevisionConfig(
            vision_config=SiglipVisionConfig(**tower),
            text_config=text,
            image_token_index=ids["<image>"],
            video_token_index=ids["<video>"],
            vision_feature_select_strategy="full",
            vision_feature_layer=-1,
            image_grid_pinpoints=ONEVISION_PINPOINTS,
            vision_aspect_ratio=VISION_ASPECT_RATIO,
            **extra,
        )
        processor = LlavaOnevisionProcessor(
            image_processor=LlavaOnevisionImageProcessor(
                size={"height": TILE, "width": TILE}, image_grid_pinpoints=ONEVISION_PINPOINTS
            ),
            tokenizer=tokenizer,
            video_processor=LlavaOnevisionVideoProcessor(size={"height": TILE, "width": TILE}),
            num_image_tokens=(TILE // PATCH) ** 2,
            vision_feature_select_strategy="full",
            vision_aspect_ratio=VISION_ASPECT_RATIO,
            chat_template=TEMPLATE,
        )
    else:
        config = LlavaNextConfig(
            vision_config=CLIPVisionConfig(projection_dim=32, **tower),
            text_config=text,
            image_token_index=ids["<image>"],
            vision_feature_select_strategy="default",
            vision_feature_layer=-2,
            image_grid_pinpoints=NEXT_PINPOINTS,
            **extra,
        )
        processor = LlavaNextProcessor(
            image_processor=LlavaNextImageProcessor(
                size={"shortest_edge": TILE},
                crop_size={"height": TILE, "width": TILE},
                image_grid_pinpoints=NEXT_PINPOINTS,
            ),
            tokenizer=tokenizer,
            patch_size=PATCH,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            chat_template=TEMPLATE,
        )
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        text.bos_token_id,
        text.eos_token_id,
        text.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    _save(model, processor, out, ids["</s>"], ids["<pad>"], ids["<s>"])
