"""``POST /v1/completions`` request model.

Accepted: ``prompt`` as a non-empty string or a non-empty list of token ids (ints >= 0);
batched prompts (a list of strings or of token lists) are rejected with a clear 400. Default
``max_tokens`` is 16 (the OpenAI default for this endpoint). ``echo``, ``suffix``,
``best_of`` > 1, logprobs, logit bias and penalties are rejected.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from mmis.frontend.schemas.common import reject_unsupported
from mmis.frontend.schemas.sampling import SamplingRequest

DEFAULT_COMPLETION_MAX_TOKENS = 16

_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "echo": (),
    "suffix": ("",),
    "best_of": (1,),
    "logprobs": (),
    "logit_bias": (),
    "frequency_penalty": (),
    "presence_penalty": (),
}


class CompletionRequest(SamplingRequest):
    prompt: str | list[int]
    max_tokens: int | None = Field(default=DEFAULT_COMPLETION_MAX_TOKENS, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return reject_unsupported(cls.__name__, data, _UNSUPPORTED)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        if isinstance(value, str):
            if not value:
                raise ValueError("must not be empty")
            return value
        if isinstance(value, list) and value:
            if all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
                return value
            if all(isinstance(t, str | list) for t in value):
                raise ValueError("batched prompts are not supported; send one prompt per request")
        raise ValueError("must be a non-empty string or a non-empty list of token ids")
