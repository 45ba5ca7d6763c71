"""OpenAI request models: what we accept, and 400s that name the offending param."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mmis.frontend.api.schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    CompletionRequest,
    EmbeddingRequest,
    ImagePart,
    TextPart,
    Usage,
    parse_request,
    sse_chunk,
)
from mmis.frontend.errors import InvalidRequestError, error_body

USER = {"role": "user", "content": "hello"}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [USER], **fields}


def bad(model: type, body: Any, **kwargs: Any) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        parse_request(model, body, **kwargs)
    assert info.value.status == 400
    assert error_body(info.value)["error"]["type"] == "invalid_request_error"
    return info.value


def test_full_chat_request_with_images_and_uuids() -> None:
    body = chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "compare"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                    {"type": "image_url", "image_url": {"url": "https://x/y.png", "uuid": "u1"}},
                    {"type": "image_url", "image_url": {"uuid": "u2"}},
                    {"type": "image_url", "uuid": "u3"},
                    {"type": "image_url", "image_url": "https://x/z.png"},
                ],
            },
            {"role": "assistant", "content": None},
        ],
        stream=True,
        stream_options={"include_usage": True},
        n=2,
        max_tokens=5,
        max_completion_tokens=7,
        temperature=0.0,
        top_p=0.5,
        seed=42,
        stop=["\n", "END"],
        user="alice",
        some_future_field={"ignored": True},
    )
    request = parse_request(ChatCompletionRequest, json.dumps(body).encode())
    parts = list(request.image_parts())
    assert [p for p, _ in parts] == [f"messages[1].content[{j}]" for j in range(1, 6)]
    images = [part for _, part in parts]
    assert [i.url for i in images] == [
        "data:image/png;base64,AA==",
        "https://x/y.png",
        None,
        None,
        "https://x/z.png",
    ]
    assert [i.item_uuid for i in images] == [None, "u1", "u2", "u3", None]
    assert [i.hash_only for i in images] == [False, False, True, True, False]
    assert request.include_usage
    params = request.to_sampling_params(default_max_tokens=100)
    assert (params.n, params.max_tokens, params.temperature, params.top_p) == (2, 7, 0.0, 0.5)
    assert (params.seed, params.stop) == (42, ["\n", "END"])


def test_string_content_is_one_text_part_and_defaults_apply() -> None:
    request = parse_request(ChatCompletionRequest, chat())
    assert request.messages[0].parts() == [TextPart(type="text", text="hello")]
    params = request.to_sampling_params(default_max_tokens=33)
    assert (params.n, params.temperature, params.top_p, params.max_tokens) == (1, 1.0, 1.0, 33)
    assert not request.include_usage
    assert parse_request(ChatCompletionRequest, chat(stop="x")).stop_list() == ["x"]
    assert params.ignore_eos is False
    ignoring = parse_request(ChatCompletionRequest, chat(ignore_eos=True))
    assert ignoring.to_sampling_params(default_max_tokens=33).ignore_eos is True


@pytest.mark.parametrize(
    ("fields", "param", "text"),
    [
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"n": 17}, "n", "at most 16"),
        ({"temperature": 2.01}, "temperature", "less than or equal to 2"),
        ({"temperature": -0.1}, "temperature", "greater than or equal to 0"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
        ({"seed": -1}, "seed", "greater than or equal to 0"),
        ({"stop": [""]}, "stop", "must not be empty"),
        ({"stop": ["s"] * 17}, "stop", "at most 16"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
        ({"messages": []}, "messages", "at least 1 item"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "'user'"),
        ({"messages": [{"role": "user"}]}, "messages[0]", "content is required"),
        ({"functions": [{"name": "f"}]}, "functions", "not supported"),
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least 1"),
    ],
)
def test_chat_range_and_shape_errors_name_the_param(
    fields: dict[str, Any], param: str, text: str
) -> None:
    error = bad(ChatCompletionRequest, chat(**fields))
    assert error.param == param
    assert text in error.message
    assert error.message.startswith(param)


def test_max_n_comes_from_the_server_limit() -> None:
    assert parse_request(ChatCompletionRequest, chat(n=20), max_n=32).n == 20
    assert bad(ChatCompletionRequest, chat(n=5), max_n=4).param == "n"


def test_default_valued_unsupported_params_are_accepted() -> None:
    body = chat(tools=[], logprobs=False, tool_choice="none", response_format={"type": "text"})
    parse_request(ChatCompletionRequest, body)


@pytest.mark.parametrize(
    ("content", "param", "text"),
    [
        ([{"type": "image_url"}], "messages[0].content[0]", "needs image_url.url"),
        ([{"type": "image_url", "image_url": {}}], "messages[0].content[0]", "url or a uuid"),
        (
            [{"type": "image_url", "image_url": {"url": ""}}],
            "messages[0].content[0].image_url.url",
            "at least 1 character",
        ),
        (
            [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"uuid": 7}}],
            "messages[0].content[1].image_url.uuid",
            "valid string",
        ),
        (
            [{"type": "image_url", "uuid": "a", "image_url": {"uuid": "b"}}],
            "messages[0].content[0]",
            "differ",
        ),
        ([{"type": "audio", "data": "x"}], "messages[0].content[0]", "'text' or 'image_url'"),
        (5, "messages[0].content", "string or a list of content parts"),
    ],
)
def test_content_part_errors_name_the_part(content: Any, param: str, text: str) -> None:
    error = bad(ChatCompletionRequest, chat(messages=[{"role": "user", "content": content}]))
    assert error.param == param
    assert text in error.message


def test_images_only_in_user_messages() -> None:
    message = {"role": "system", "content": [{"type": "image_url", "uuid": "a"}]}
    error = bad(ChatCompletionRequest, chat(messages=[message]))
    assert error.param == "messages[0]"
    assert "only allowed in user messages" in error.message


def test_body_must_be_a_json_object() -> None:
    assert "not valid JSON" in bad(ChatCompletionRequest, b"{nope").message
    assert "JSON object" in bad(ChatCompletionRequest, b"[1, 2]").message


def test_completion_prompts() -> None:
    assert parse_request(CompletionRequest, {"prompt": "hi"}).max_tokens == 16
    assert parse_request(CompletionRequest, {"prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert "batched" in bad(CompletionRequest, {"prompt": ["a", "b"]}).message
    for prompt in ("", [], [1, -2], [1, "a"], None):
        assert bad(CompletionRequest, {"prompt": prompt}).param == "prompt"
    echo = parse_request(CompletionRequest, {"prompt": "x", "echo": True, "logprobs": 0})
    assert echo.to_sampling_params(16).prompt_logprobs == 0  # prompt logprobs
    assert parse_request(CompletionRequest, {"prompt": "x", "echo": True}).echo
    assert bad(CompletionRequest, {"prompt": "x", "best_of": 3}).param == "best_of"
    parse_request(CompletionRequest, {"prompt": "x", "best_of": 1, "echo": False})


def test_embedding_inputs() -> None:
    assert parse_request(EmbeddingRequest, {"input": "a"}).items() == ["a"]
    assert parse_request(EmbeddingRequest, {"input": ["a", "b"]}).items() == ["a", "b"]
    assert parse_request(EmbeddingRequest, {"input": [5, 6]}).items() == [[5, 6]]
    mm = parse_request(
        EmbeddingRequest,
        {
            "input": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                {"type": "text", "text": "a caption"},
            ],
            "encoding_format": "base64",
        },
    )
    assert mm.is_multimodal
    (item,) = mm.items()
    assert isinstance(item, list) and isinstance(item[0], ImagePart)
    assert [p for p, _ in mm.image_parts()] == ["input[0]"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": 3}, "input"),
        ({"input": [1, "a"]}, "input[1]"),
        ({"input": ["a", ""]}, "input[1]"),
        ({"input": [{"type": "image_url", "image_url": {"url": ""}}]}, "input[0].image_url.url"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "x", "dimensions": 8}, "dimensions"),
    ],
)
def test_embedding_errors_name_the_param(body: dict[str, Any], param: str) -> None:
    assert bad(EmbeddingRequest, body).param == param


def test_stream_chunk_shape() -> None:
    chunk = ChatCompletionChunk(
        id="chatcmpl-1",
        model="m",
        choices=[ChatChunkChoice(index=0, delta=ChatDelta(role="assistant", content="hi"))],
    )
    event = sse_chunk(chunk)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    decoded = json.loads(event[len(b"data: ") :])
    assert decoded["object"] == "chat.completion.chunk"
    assert decoded["choices"][0]["delta"] == {"role": "assistant", "content": "hi"}
    assert decoded["usage"] is None
    usage = Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    assert ChatCompletionChunk(id="c", model="m", choices=[], usage=usage).usage == usage
