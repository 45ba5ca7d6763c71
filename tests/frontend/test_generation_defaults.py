"""The model's generation-config sampling values as request defaults (unit, real configs)."""

from __future__ import annotations

from pathlib import Path

from transformers import GenerationConfig

from mmis.frontend.api import generation_defaults
from mmis.frontend.api.schemas import ChatCompletionRequest, CompletionRequest


def _model(tmp_path: Path, **values: object) -> str:
    GenerationConfig(**values).save_pretrained(tmp_path)
    return str(tmp_path)


def test_only_non_default_sampling_fields_are_taken(tmp_path: Path) -> None:
    model = _model(
        tmp_path, do_sample=True, temperature=0.01, top_p=0.001, top_k=1, repetition_penalty=1.05,
        max_new_tokens=7, eos_token_id=[3, 4], num_beams=1,
    )  # fmt: skip
    assert generation_defaults.load(model, None) == {
        "temperature": 0.01,
        "top_p": 0.001,
        "top_k": 1,
        "repetition_penalty": 1.05,
        "max_tokens": 7,
    }
    assert generation_defaults.load(model, None, "none") == {}
    assert generation_defaults.load(str(tmp_path / "absent"), None) == {}


def test_what_a_request_sets_wins(tmp_path: Path) -> None:
    defaults = {"temperature": 0.0, "max_tokens": 7, "top_k": 1}
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.9}
    )
    filled = generation_defaults.apply(chat, defaults)
    assert (filled.temperature, filled.max_tokens, filled.top_k) == (0.9, 7, 1)
    # completions' own default (16 tokens) gives way to the model's: the request omitted it
    completion = generation_defaults.apply(
        CompletionRequest.model_validate({"prompt": "hi"}), defaults
    )
    assert completion.max_tokens == 7
    explicit = CompletionRequest.model_validate({"prompt": "hi", "max_tokens": 16})
    assert generation_defaults.apply(explicit, defaults).max_tokens == 16
    assert generation_defaults.apply(chat, {}) is chat
