"""Tokenizers and chat templates of the tiny models (see :mod:`mmis.engine.tiny_model`).

Invariants:
- Deterministic: a byte-level BPE trained on a fixed corpus; the same specials always get the
  same ids (they come first in the vocabulary).
- Both chat templates accept a message content that is a string or a list of parts; a part of
  type "image" or "image_url" becomes the family's image marker, which the processor expands.
"""

from __future__ import annotations

from typing import Any

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Describe this image in one short sentence, please.",
    "What is in the picture? A red square, a blue circle and a green line.",
    "A cat sits on a warm mat near the window while it rains outside.",
    "Hello, how are you today? I am fine, thank you very much!",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "The model answers questions about images and text.",
    "Serving multimodal models on Kubernetes with a small engine core.",
]

LLAVA_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

LLAVA_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] if message['content'] is string "
    "else message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') "
    "| join(' ') }}{{ '\\n' }}"
    "{% else %}{{ message['role'] | upper }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<image>{{ '\\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(specials: list[str], vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def token_ids(tokenizer: Any, tokens: list[str]) -> dict[str, int]:
    return {t: int(tokenizer.convert_tokens_to_ids(t)) for t in tokens}
