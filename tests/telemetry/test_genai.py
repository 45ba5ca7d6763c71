"""GenAI semantic-convention names: spelled as the OpenTelemetry conventions spell them."""

from __future__ import annotations

import pytest
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as semconv

from mmis.telemetry import genai
from mmis.telemetry.errors import TelemetryError


def test_attribute_names_match_the_published_conventions() -> None:
    assert genai.OPERATION_NAME == semconv.GEN_AI_OPERATION_NAME
    assert genai.PROVIDER_NAME == semconv.GEN_AI_PROVIDER_NAME
    assert genai.REQUEST_MODEL == semconv.GEN_AI_REQUEST_MODEL
    assert genai.RESPONSE_MODEL == semconv.GEN_AI_RESPONSE_MODEL
    assert genai.USAGE_INPUT_TOKENS == semconv.GEN_AI_USAGE_INPUT_TOKENS
    assert genai.USAGE_OUTPUT_TOKENS == semconv.GEN_AI_USAGE_OUTPUT_TOKENS
    assert genai.USAGE_CACHE_READ_INPUT_TOKENS == semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS
    ops = semconv.GenAiOperationNameValues
    assert {ops.CHAT.value, ops.TEXT_COMPLETION.value, ops.EMBEDDINGS.value} == genai.OPERATIONS


def test_helpers_build_the_conventional_name_and_attributes() -> None:
    assert genai.span_name(genai.OP_EMBEDDINGS, "tiny") == "embeddings tiny"
    assert genai.request_attributes(genai.OP_CHAT, "tiny")[genai.REQUEST_MODEL] == "tiny"
    usage = genai.usage_attributes(10, 3, cache_read_input_tokens=4)
    assert usage == {
        "gen_ai.usage.input_tokens": 10,
        "gen_ai.usage.output_tokens": 3,
        "gen_ai.usage.cache_read.input_tokens": 4,
    }


@pytest.mark.parametrize(
    ("args", "match"),
    [((-1, 0, 0), "input_tokens"), ((1, -1, 0), "output_tokens"), ((2, 0, 3), "exceeds")],
)
def test_bad_usage_is_a_typed_error(args: tuple[int, int, int], match: str) -> None:
    with pytest.raises(TelemetryError, match=match):
        genai.usage_attributes(*args)


def test_unknown_operation_is_a_typed_error() -> None:
    with pytest.raises(TelemetryError, match="operation"):
        genai.span_name("generate", "tiny")
