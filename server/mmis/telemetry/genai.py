"""GenAI semantic-convention attribute names and values, as mmis uses them on spans.

Our own constants (not imported from the incubating ``opentelemetry-semantic-conventions``
module, whose names move between releases). They follow the current OpenTelemetry GenAI
conventions: operation ``chat`` | ``text_completion`` | ``embeddings``; span name
``"{gen_ai.operation.name} {gen_ai.request.model}"``; token usage as
``gen_ai.usage.input_tokens`` / ``gen_ai.usage.output_tokens``, and prompt tokens served from
the prefix cache as ``gen_ai.usage.cache_read.input_tokens`` (a subset of the input tokens).

Invariant: every span attribute mmis sets under ``gen_ai.*`` is spelled here, once; the
helpers reject negative counts and unknown operations with :class:`TelemetryError`.
"""

from __future__ import annotations

from mmis.telemetry.errors import TelemetryError

OPERATION_NAME = "gen_ai.operation.name"
PROVIDER_NAME = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_ID = "gen_ai.response.id"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"

OP_CHAT = "chat"
OP_TEXT_COMPLETION = "text_completion"
OP_EMBEDDINGS = "embeddings"
OPERATIONS = frozenset({OP_CHAT, OP_TEXT_COMPLETION, OP_EMBEDDINGS})

PROVIDER = "mmis"

AttributeValue = str | int | float | bool


def span_name(operation: str, model: str) -> str:
    """The conventional span name of an inference call."""
    _check_operation(operation)
    return f"{operation} {model}"


def request_attributes(operation: str, model: str) -> dict[str, AttributeValue]:
    _check_operation(operation)
    return {OPERATION_NAME: operation, PROVIDER_NAME: PROVIDER, REQUEST_MODEL: model}


def usage_attributes(
    input_tokens: int, output_tokens: int, cache_read_input_tokens: int = 0
) -> dict[str, AttributeValue]:
    """Token usage; ``cache_read_input_tokens`` are prompt tokens found in the prefix cache."""
    for name, value in (
        ("input_tokens", input_tokens),
        ("output_tokens", output_tokens),
        ("cache_read_input_tokens", cache_read_input_tokens),
    ):
        if value < 0:
            raise TelemetryError(f"{name} must be >= 0, got {value}")
    if cache_read_input_tokens > input_tokens:
        raise TelemetryError(
            f"cache_read_input_tokens={cache_read_input_tokens} exceeds input_tokens={input_tokens}"
        )
    return {
        USAGE_INPUT_TOKENS: input_tokens,
        USAGE_OUTPUT_TOKENS: output_tokens,
        USAGE_CACHE_READ_INPUT_TOKENS: cache_read_input_tokens,
    }


def _check_operation(operation: str) -> None:
    if operation not in OPERATIONS:
        raise TelemetryError(f"GenAI operation {operation!r} is not one of {sorted(OPERATIONS)}")
