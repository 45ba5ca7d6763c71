"""``POST /v1/completions`` request model.

Accepted: ``prompt`` as a non-empty string or a non-empty list of token ids (ints in
[0, 2**31); the engine checks them against the model's vocabulary);
batched prompts (a list of strings or of token lists) are rejected with a clear 400. Default
``max_tokens`` is 16 (the OpenAI default for this endpoint). ``logprobs`` (0-5 alternatives
per token) is answered in the legacy column layout. ``echo: true`` prepends the prompt to each
choice's text; with ``logprobs`` too, each choice's ``logprobs`` covers the prompt tokens first
(prompt logprobs, computed in P1; the first prompt token's logprob and top_logprobs are
``null``), then the generated ones, ``text_offset`` running across. ``response_format`` and
``structured_outputs`` constrain the text as on chat (``schemas/sampling.py``). ``suffix``
and ``best_of`` > 1 are rejected.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field, field_validator, model_validator

from mmis.frontend.api.schemas.common import (
    TOKEN_ID_LIMIT,
    add_sampling_rules,
    add_unsupported_to_schema,
    reject_unsupported,
)
from mmis.frontend.api.schemas.sampling import MAX_COMPLETION_LOGPROBS, MAX_STOP, SamplingRequest
from mmis.protocol.messages import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16

_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "suffix": ("",),
    "best_of": (1,),
}


TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=TOKEN_ID_LIMIT)]], Field(min_length=1)]


def _request_schema(schema: dict[str, Any], model: type[Any]) -> None:
    add_unsupported_to_schema(schema, model, _UNSUPPORTED)
    add_sampling_rules(schema, MAX_STOP)


class CompletionRequest(SamplingRequest):
    model_config = ConfigDict(json_schema_extra=_request_schema)

    prompt: Annotated[str, Field(min_length=1)] | TokenIds
    max_tokens: int | None = Field(default=DEFAULT_COMPLETION_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = Field(
        default=False,
        description="Prepend the prompt to each choice's text; with logprobs, the prompt "
        "tokens' logprobs come first (the first one null).",
    )

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        params = super().to_sampling_params(default_max_tokens)
        if self.echo and self.logprobs is not None:
            params.prompt_logprobs = self.logprobs  # echo with logprobs: prompt logprobs
        return params

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return reject_unsupported(cls, data, _UNSUPPORTED)

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
