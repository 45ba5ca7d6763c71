"""Tokenizers and chat templates of the tiny models (see :mod:`mmis.tiny_models.tiny_model`).

Invariants:
- Deterministic: a byte-level BPE trained on a fixed corpus; the same specials always get the
  same ids (they come first in the vocabulary).
- No control bytes: the vocabulary holds no token for the C0 control characters and DEL
  (:data:`CONTROL_CHARS`: every byte below 0x20 but tab and newline, which the chat templates
  and tool formats write, and 0x7f), so a random tiny model can never emit ``\x1b`` or
  ``\x00`` (a terminal showing the answer would take them as commands). A normalizer drops
  them from any input. Every other byte, 0x80-0xff included, keeps its token, so any other
  text still encodes.
- Both chat templates accept a message content that is a string or a list of parts; a part of
  type "image" or "image_url" becomes the family's image marker, which the processor expands.
- The Qwen template writes tools, assistant tool calls and tool results as Qwen2.5 does (the
  format ``frontend/api/tool_calls.py`` parses); the LLaVA one has no tool format.
- A template change reaches cached models: ``tiny_model.fingerprint`` hashes the template.
"""

from __future__ import annotations

import re
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

_QWEN_CONTENT = (
    "{% macro content(c) %}{% if c is string %}{{ c }}{% elif c %}"
    "{% for part in c %}"
    "{% if part['type'] in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] in ('video', 'video_url') %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endmacro %}"
)
# Qwen2.5's tool format: the tool signatures in a <tools> system block, calls as
# <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, results as <tool_response>
# in a user turn (consecutive tool messages share one). Without tools: as before.
_QWEN_TOOLS = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ content(messages[0]['content']) }}"
    "{{ '\n\n' }}{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\n' }}</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
)
_QWEN_CALLS = (
    "<|im_start|>assistant{% if message['content'] %}{{ '\n' }}"
    "{{ content(message['content']) }}{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{% set f = call['function'] if call['function'] is defined else call %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' }}{{ f['name'] }}{{ '\", \"arguments\": ' }}"
    "{% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}"
    "{{ f['arguments'] | tojson }}{% endif %}{{ '}\\n</tool_call>' }}"
    "{% endfor %}<|im_end|>{{ '\\n' }}"
)
_QWEN_TOOL_RESULT = (
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user"
    "{% endif %}{{ '\\n<tool_response>\\n' }}{{ content(message['content']) }}"
    "{{ '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>{{ '\\n' }}"
    "{% endif %}"
)
QWEN_TEMPLATE = (
    _QWEN_CONTENT + _QWEN_TOOLS + "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    + _QWEN_CALLS
    + "{% elif message['role'] == 'tool' %}"
    + _QWEN_TOOL_RESULT
    + "{% else %}<|im_start|>{{ message['role'] }}\n{{ content(message['content']) }}"
    "<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# the characters no tiny tokenizer has a token for (and drops from its input)
CONTROL_CHARS = "".join(chr(b) for b in [*range(0x20), 0x7F] if chr(b) not in "\t\n")


def train_tokenizer(specials: list[str], vocab_size: int) -> Any:
    """A byte-level BPE of ``vocab_size`` tokens, ``specials`` first, without a token for
    any of :data:`CONTROL_CHARS` (a normalizer removes them from the input)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(Regex(f"[{re.escape(CONTROL_CHARS)}]"), "")
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # the byte-level alphabet maps each byte to a printable stand-in: leave out the stand-ins
    # of the control bytes (each is one byte, so it pre-tokenizes to exactly its stand-in)
    bytes_only = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    controls = {bytes_only.pre_tokenize_str(c)[0][0] for c in CONTROL_CHARS}
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=sorted(set(pre_tokenizers.ByteLevel.alphabet()) - controls),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def token_ids(tokenizer: Any, tokens: list[str]) -> dict[str, int]:
    return {t: int(tokenizer.convert_tokens_to_ids(t)) for t in tokens}
