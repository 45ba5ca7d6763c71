"""Sampling fields shared by ``/v1/chat/completions`` and ``/v1/completions``.

Ranges (each violation is a 400 naming the field): ``n`` in [1, max_n] (``max_n`` from the
validation context, default :data:`DEFAULT_MAX_N`), ``temperature`` in [0, 2], ``top_p`` in
(0, 1], ``top_k`` >= 0 (extension; 0 = off), ``max_tokens`` >= 1, ``seed`` in [0, 2**63),
``stop`` a string or up to :data:`MAX_STOP` non-empty strings, ``stream_options`` only with
``stream: true``, ``presence_penalty`` and ``frequency_penalty`` in [-2, 2] (OpenAI),
``repetition_penalty`` > 0 (extension, as in vLLM; 1 = off), ``min_p`` in [0, 1] (extension),
``logit_bias`` at most :data:`MAX_LOGIT_BIAS` entries of token id (a decimal string key, as
JSON objects need) -> bias in [-100, 100]. Every float must be finite. Token ids beyond the
model's vocabulary are refused by the engine (also a 400 that names ``logit_bias``).
The limits are the engine's (``mmis.engine.execution.sampler``); the two sides check them alike.

Structured outputs (``mmis.frontend.api.structured_outputs`` turns them into the wire constraint):
``response_format`` is ``{"type": "text"}``, ``{"type": "json_object"}`` or
``{"type": "json_schema", "json_schema": {"name", "description"?, "schema"?, "strict"?}}``
(``name``: 1-64 of ``[a-zA-Z0-9_-]``, as OpenAI requires); ``structured_outputs`` (vLLM's
extra_body field) sets exactly one of ``json``, ``json_object``, ``regex``, ``choice``,
``grammar`` (any other key, e.g. ``structural_tag``, is a 400 naming it). The two fields
together are a 400. A schema, regex or grammar the engine cannot compile is a 400 naming the
field that carried it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from mmis.frontend.api import structured_outputs
from mmis.frontend.api.schemas.common import OpenAIModel
from mmis.protocol.messages import SamplingParams, StructuredOutputs

DEFAULT_MAX_N = 16
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (OpenAI's limit; P1 checks the same)
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs (OpenAI's limit)
MAX_STOP = 16
MAX_LOGIT_BIAS = 300  # = engine/scheduling/sampling_params.py MAX_LOGIT_BIAS (P0 imports no engine)


TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]  # JSON object keys are strings
Bias = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]
LogitBias = Annotated[dict[TokenIdKey, Bias], Field(max_length=MAX_LOGIT_BIAS)]


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self

    def constraint(self) -> StructuredOutputs | None:
        if self.type == "json_schema" and self.json_schema is not None:
            if self.json_schema.schema_ is None:
                return structured_outputs.json_object(param="response_format")
            return structured_outputs.json_schema(self.json_schema.schema_, param="response_format")
        return structured_outputs.from_response_format({"type": self.type})


_VLLM_KEYS = ("json", "json_object", "regex", "choice", "grammar")


def _exactly_one_key(schema: dict[str, Any]) -> None:
    """The document's form of the rule: one key set (not null / false), the rest unset."""
    unset = {"enum": [None, False]}
    schema["anyOf"] = [
        {
            "required": [key],
            "properties": {k: ({"not": unset} if k == key else unset) for k in _VLLM_KEYS},
        }
        for key in _VLLM_KEYS
    ]


NonEmpty = Annotated[str, Field(min_length=1, max_length=structured_outputs.MAX_SPEC_CHARS)]


class VllmStructuredOutputs(OpenAIModel):
    """vLLM's ``structured_outputs`` extra_body object (exactly one key set)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_exactly_one_key)

    json_: dict[str, Any] | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: NonEmpty | None = None
    choice: (
        Annotated[list[NonEmpty], Field(min_length=1, max_length=structured_outputs.MAX_CHOICES)]
        | None
    ) = None
    grammar: Annotated[NonEmpty, Field(pattern=r"\S")] | None = None

    def constraint(self) -> StructuredOutputs:
        return structured_outputs.from_vllm_fields(
            {
                "json": self.json_,
                "json_object": self.json_object,
                "regex": self.regex,
                "choice": self.choice,
                "grammar": self.grammar,
            }
        )


class SamplingRequest(OpenAIModel):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    user: str | None = Field(default=None, max_length=256)
    ignore_eos: bool = False  # extension (as in vLLM): decode to max_tokens past end-of-sequence
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    logit_bias: LogitBias | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: VllmStructuredOutputs | None = None  # extension (vLLM's extra_body)

    @field_validator("response_format", "structured_outputs")
    @classmethod
    def _constraint_checks(cls, value: Any) -> Any:
        if value is not None:
            try:
                value.constraint()
            except structured_outputs.StructuredOutputsError as exc:
                raise ValueError(str(exc)) from exc
        return value

    @field_validator("structured_outputs")
    @classmethod
    def _one_constraint(cls, value: Any, info: ValidationInfo) -> Any:
        other = info.data.get("response_format")
        if value is not None and other is not None and other.type != "text":
            raise ValueError("cannot be combined with a response_format other than text")
        return value

    @field_validator("n")
    @classmethod
    def _n_at_most_max(cls, value: int, info: ValidationInfo) -> int:
        context = info.context if isinstance(info.context, dict) else {}
        limit = int(context.get("max_n", DEFAULT_MAX_N))
        if value > limit:
            raise ValueError(f"must be at most {limit} (the server's max_n)")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else (value or [])
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed")
        if any(not item for item in items):
            raise ValueError("stop sequences must not be empty")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream", False):
            raise ValueError("is only allowed when stream is true")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> int | None:
        """The client's output-token cap (``None``: up to the context window)."""
        return self.max_tokens

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The wire sampling parameters; ``default_max_tokens`` applies when none was asked."""
        requested = self.requested_max_tokens()
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            max_tokens=default_max_tokens if requested is None else requested,
            stop=self.stop_list(),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            logit_bias={int(k): float(v) for k, v in (self.logit_bias or {}).items()},
            logprobs=self.logprobs_count(),
            structured=self.structured_constraint(),
        )

    def structured_constraint(self) -> StructuredOutputs | None:
        """The output constraint the request asked for (``None``: unconstrained)."""
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        if self.response_format is not None:
            return self.response_format.constraint()
        return None

    def logprobs_count(self) -> int | None:
        """How many alternatives per token the client wants with its logprobs (``None``: no
        logprobs); each endpoint spells it its own way."""
        return None


def context_for(max_n: int) -> dict[str, Any]:
    """The pydantic validation context carrying the server's limits."""
    return {"max_n": max_n}
