"""The tiny models' vocabularies hold no control bytes (issue 48 item 6).

A random tiny model emits any token of its vocabulary; a token that decodes to ``\\x1b`` or
``\\x00`` makes the demo's answer look broken in a terminal. The chat templates need ``\\n``
(and tab is harmless), so those two stay. The served side (tokens sampled by ``mmis serve``)
is checked in tests/e2e/test_quiet_logs.py.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from mmis.tiny_models import tiny_gemma3
from mmis.tiny_models.tiny_model import tiny_model_dir
from mmis.tiny_models.tiny_tokenizer import (
    CONTROL_CHARS,
    LLAVA_SPECIALS,
    QWEN_SPECIALS,
    train_tokenizer,
)

VOCAB = 448  # what the builders ask for; tests/frontend/fake_engine.py reads ids 262..447


def test_control_chars_are_the_c0_set_but_tab_and_newline_plus_del() -> None:
    assert len(CONTROL_CHARS) == 31 and "\t" not in CONTROL_CHARS and "\n" not in CONTROL_CHARS
    assert {"\x00", "\x1b", "\r", "\x7f"} <= set(CONTROL_CHARS)


@pytest.mark.parametrize(
    "specials",
    [LLAVA_SPECIALS, QWEN_SPECIALS, tiny_gemma3.SPECIALS],
    ids=["llava", "qwen", "gemma3"],
)
def test_no_token_decodes_to_a_control_char(specials: list[str]) -> None:
    tok = train_tokenizer(specials, VOCAB)
    assert tok.get_vocab_size() == VOCAB
    bad = {}
    for i in range(len(specials), VOCAB):
        text = tok.decode([i])
        if set(text) & set(CONTROL_CHARS):
            bad[i] = text
    assert not bad, f"tokens that decode to control characters: {bad}"
    # the fake engine's token range decodes to printable ASCII (merges of the corpus)
    assert all(tok.decode([i]).isascii() for i in range(262, VOCAB))


def test_built_model_drops_control_chars_and_keeps_other_text() -> None:
    """The saved tokenizer of the default tiny model (what ``mmis serve`` loads)."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir())
    ids = tok("a\x1b[31mb\x00c\r\nd\tcafé 🙂", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "a[31mbc\nd\tcafé 🙂"
    decoded = [tok.decode([i]) for i in range(len(tok))]
    assert not [t for t in decoded if set(t) & set(CONTROL_CHARS)]
    # the chat template's newlines still encode as themselves
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert tok.decode(tok(prompt, add_special_tokens=False)["input_ids"]) == prompt
