"""The tiny Gemma 3 (``gemma3``): SigLIP tower, pooled projector, sliding-window Gemma 3 text.

What is real (Gemma 3 4B's settings, the behaviour under test): the layer pattern (sliding
layers before a full-attention layer), both RoPE bases, ``query_pre_attn_scalar``, scaled
embeddings, the SigLIP tower without a head, the average-pooled projector, the
processor's ``\\n\\n<start_of_image>`` + soft tokens + ``<end_of_image>\\n\\n`` expansion, the
``mm_token_type_ids`` that make one image's tokens attend to each other bidirectionally, and
``generation_config`` stopping at both ``<eos>`` and ``<end_of_turn>``.
What is scaled down, so tests stay fast: widths and depth, the image (64 px, patch 8, 16 soft
tokens per image instead of 896 px, patch 14, 256) and the sliding window (32 tokens instead
of 1024), so a short prompt already crosses it. The LM head is not tied to the embeddings
(Gemma 3's is): tied random weights only ever repeat the prompt's last token, which would
make every parity check pass trivially.

See :mod:`mmis.tiny_models.tiny_model` for the invariants every tiny model keeps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmis.tiny_models.tiny_tokenizer import token_ids, train_tokenizer

SPECIALS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]

# Gemma 3's turn format; a system message is folded into the first user turn, as the hub's is
TEMPLATE = (
    "{{ bos_token }}"
    "{% set first = 0 %}{% set system = '' %}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set c = messages[0]['content'] %}"
    "{% set system = (c if c is string else c | selectattr('type', 'equalto', 'text') "
    "| map(attribute='text') | join(' ')) + '\\n\\n' %}{% set first = 1 %}{% endif %}"
    "{% for message in messages[first:] %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{% if loop.first %}{{ system }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

IMAGE_SIZE, PATCH, SOFT_TOKENS, WINDOW = 64, 8, 16, 32


def build(out: Path, seed: int, family: str) -> None:
    """Write the tiny ``gemma3`` into ``out`` (``family`` must be ``"gemma3"``)."""
    if family != "gemma3":
        raise ValueError(f"tiny_gemma3 builds only 'gemma3', not {family!r}")
    import torch
    from transformers import (
        AutoModelForImageTextToText,
        Gemma3Config,
        Gemma3ImageProcessor,
        Gemma3Processor,
        PreTrainedTokenizerFast,
    )

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(SPECIALS, 448),
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        extra_special_tokens={
            "image_token": "<image_soft_token>",
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
        },
    )
    tokenizer.chat_template = TEMPLATE
    ids = token_ids(tokenizer, SPECIALS)
    text: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        "max_position_embeddings": 4096,
        "bos_token_id": ids["<bos>"],
        "eos_token_id": ids["<eos>"],
        "pad_token_id": ids["<pad>"],
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
    }
    vision: dict[str, Any] = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH,
        "vision_use_head": False,
    }
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=SOFT_TOKENS,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        ids["<bos>"],
        ids["<eos>"],
        ids["<pad>"],
    )
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessor(
            size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
            image_mean=[0.5, 0.5, 0.5],
            image_std=[0.5, 0.5, 0.5],
        ),
        tokenizer=tokenizer,
        chat_template=TEMPLATE,
        image_seq_length=SOFT_TOKENS,
    )
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():  # Gemma 3 initialises its projector to zeros: images would be blank
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2)
    gen = model.generation_config
    gen.eos_token_id = [ids["<eos>"], ids["<end_of_turn>"]]  # as the hub's generation_config
    gen.pad_token_id, gen.bos_token_id = ids["<pad>"], ids["<bos>"]
    gen.do_sample = False
    model.save_pretrained(out)
    processor.save_pretrained(out)
