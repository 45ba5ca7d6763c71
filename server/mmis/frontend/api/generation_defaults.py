"""The model's own sampling defaults (its ``generation_config.json``) for requests omitting them.

As vLLM does with ``--generation-config auto``: the sampling fields a checkpoint's generation
config sets to something other than transformers' defaults (:data:`FIELDS`: temperature,
top_p, top_k, min_p, repetition_penalty, and max_new_tokens as the default ``max_tokens``)
apply to every chat or completion request that leaves them unset; whatever a request sets
wins. ``--generation-config none`` ignores them (the OpenAI defaults: temperature 1, top_p 1).
A real Qwen2-VL, for one, asks for near-greedy decoding this way.

Invariants: loaded once at start-up (:func:`load`), read-only afterwards; a checkpoint
without a generation config has no defaults; :func:`apply` never changes a field the
request set.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel

log = logging.getLogger(__name__)

# generation_config field -> request field
FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
MODES = ("auto", "none")
R = TypeVar("R", bound=BaseModel)


def load(model: str, revision: str | None, mode: str = "auto") -> dict[str, Any]:
    """The request defaults of ``model`` (empty with ``mode="none"`` or no generation config)."""
    if mode == "none":
        return {}
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(model, revision=revision or "main")
    except OSError:
        return {}
    diff = config.to_diff_dict()
    defaults = {FIELDS[k]: v for k, v in diff.items() if k in FIELDS and v is not None}
    if defaults:
        log.info("the model's generation config sets request defaults: %s", defaults)
    return defaults


def apply(request: R, defaults: Mapping[str, Any]) -> R:
    """``request`` with each default filled in where the request did not set the field (an
    endpoint's own default, e.g. completions' 16 tokens, gives way to the model's)."""
    missing = {
        field: value
        for field, value in defaults.items()
        if field in type(request).model_fields and field not in request.model_fields_set
    }
    return request.model_copy(update=missing) if missing else request
