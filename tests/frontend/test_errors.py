"""Typed errors -> HTTP status + OpenAI error JSON, checked directly and through the real
OpenAI SDK talking to a FastAPI app (in-process ASGI transport); the SDK's parse of a normal
answer through the real serving route (a real P0 on the scripted P1)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from openai.types.chat import ChatCompletion
from scripted_stack import StackFactory  # tests/frontend (conftest.py puts it on the path)

from mmis.frontend.api.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    install_exception_handlers,
    sse_chunk,
)
from mmis.frontend.errors import (
    SSE_DONE,
    ContextLengthExceededError,
    FrontendError,
    HashOnlyCacheMissError,
    InvalidMediaError,
    InvalidRequestError,
    MediaFetchError,
    MediaForbiddenError,
    MediaTooLargeError,
    TooManyImagesError,
    error_body,
    error_status,
    from_request_error,
    sse_error_event,
)
from mmis.protocol.errors import MMISError, MultiModalCacheMissError, ProtocolError
from mmis.protocol.messages import EngineCoreOutput, EngineCoreRequest, RequestError


@pytest.mark.parametrize(
    ("exc", "status", "code", "kind"),
    [
        (InvalidRequestError("x", param="n"), 400, "invalid_request", "invalid_request_error"),
        (InvalidMediaError("x"), 400, "invalid_image", "invalid_request_error"),
        (MediaTooLargeError("x"), 400, "media_too_large", "invalid_request_error"),
        (TooManyImagesError("x"), 400, "too_many_images", "invalid_request_error"),
        (MediaFetchError("x"), 400, "media_fetch_failed", "invalid_request_error"),
        (MediaForbiddenError("x"), 403, "media_forbidden", "permission_error"),
        (ContextLengthExceededError("x"), 400, "context_length_exceeded", "invalid_request_error"),
        (HashOnlyCacheMissError(["u"]), 422, "multimodal_cache_miss", "invalid_request_error"),
        (
            MultiModalCacheMissError(["h"]),
            503,
            "multimodal_cache_miss",
            "service_unavailable_error",
        ),
        (ProtocolError("bad frame"), 400, "invalid_request", "invalid_request_error"),
        (RuntimeError("boom"), 500, "internal_error", "server_error"),
    ],
)
def test_status_and_shape(exc: BaseException, status: int, code: str, kind: str) -> None:
    assert error_status(exc) == status
    body = error_body(exc)
    assert set(body) == {"error"}
    error = body["error"]
    assert {"message", "type", "param", "code"} <= set(error)
    assert (error["code"], error["type"]) == (code, kind)
    assert error["message"]


def test_param_and_message_are_carried() -> None:
    error = error_body(InvalidRequestError("temperature: too hot", param="temperature"))["error"]
    assert error == {
        "message": "temperature: too hot",
        "type": "invalid_request_error",
        "param": "temperature",
        "code": "invalid_request",
    }


def test_hash_only_miss_names_the_uuids_and_is_retryable() -> None:
    exc = HashOnlyCacheMissError(["cat", "dog", "cat"])
    error = error_body(exc)["error"]
    assert error["retryable"] is True
    assert error["missing_uuids"] == ["cat", "dog"]
    assert "cat" in error["message"] and "resend" in error["message"]
    assert exc.to_wire().retryable


def test_cache_miss_after_retry_is_503_with_hashes() -> None:
    error = error_body(MultiModalCacheMissError(["h1", "h2"]))["error"]
    assert error["missing_mm_hashes"] == ["h1", "h2"]
    assert error["retryable"] is True


def test_internal_errors_do_not_leak_their_text() -> None:
    error = error_body(RuntimeError("password=hunter2"))["error"]
    assert "hunter2" not in json.dumps(error)


def test_from_request_error() -> None:
    miss = from_request_error(RequestError("multimodal_cache_miss", "m", True), ["a", "b"])
    assert isinstance(miss, MultiModalCacheMissError) and miss.mm_hashes == ["a", "b"]
    too_long = from_request_error(RequestError("context_length_exceeded", "prompt is 9000"))
    assert isinstance(too_long, ContextLengthExceededError)
    assert error_status(too_long) == 400 and "9000" in error_body(too_long)["error"]["message"]
    assert error_status(from_request_error(RequestError("invalid_request", "bad"))) == 400
    internal = from_request_error(RequestError("weird_new_code", "?"))
    assert isinstance(internal, MMISError) and error_status(internal) == 500


def test_sse_error_event_shape() -> None:
    event = sse_error_event(MultiModalCacheMissError(["h"]))
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:])["error"]["code"] == "multimodal_cache_miss"
    assert SSE_DONE == b"data: [DONE]\n\n"


# ---------------------------------------------------------------- through the OpenAI SDK


def make_app(hits: list[str]) -> FastAPI:
    app = FastAPI()
    install_exception_handlers(app)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: ChatCompletionRequest) -> Any:
        hits.append("chat")
        missing = [p.item_uuid for _, p in request.image_parts() if p.hash_only]
        if missing:
            raise HashOnlyCacheMissError([m for m in missing if m])
        if request.user == "drift":
            raise MultiModalCacheMissError(["h1"])
        if request.stream:
            return StreamingResponse(_stream(), media_type="text/event-stream")
        return ChatCompletionResponse(
            id="c1",
            model="m",
            choices=[ChatChoice(index=0, message=AssistantMessage(content="ok"))],
        )

    return app


async def _stream() -> AsyncIterator[bytes]:
    delta = ChatDelta(role="assistant", content="hi")
    yield sse_chunk(
        ChatCompletionChunk(id="c1", model="m", choices=[ChatChunkChoice(index=0, delta=delta)])
    )
    yield sse_error_event(MultiModalCacheMissError(["h1"]))
    yield SSE_DONE


def client_for(app: FastAPI, retries: int = 0) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t/v1")
    return openai.AsyncOpenAI(
        api_key="k", base_url="http://t/v1", http_client=http, max_retries=retries
    )


MSG: list[Any] = [{"role": "user", "content": "hi"}]


async def test_sdk_sees_a_400_naming_the_param() -> None:
    client = client_for(make_app([]))
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model="m", messages=MSG, temperature=3)
    assert info.value.status_code == 400
    assert info.value.param == "temperature"
    assert info.value.code == "invalid_request"
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],  # type: ignore[list-item,typeddict-item]
        )
    assert info.value.param == "messages[0].content[0]"


async def test_sdk_gets_the_hash_only_422_once_not_retried() -> None:
    hits: list[str] = []
    client = client_for(make_app(hits), retries=2)
    content: Any = [{"type": "image_url", "image_url": {"uuid": "cat-1"}}]
    with pytest.raises(openai.UnprocessableEntityError) as info:
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": content}]
        )
    assert info.value.code == "multimodal_cache_miss"
    body: Any = info.value.body
    assert body["missing_uuids"] == ["cat-1"] and body["retryable"] is True
    assert hits == ["chat"]


async def test_sdk_gets_the_503() -> None:
    client = client_for(make_app([]))
    with pytest.raises(openai.InternalServerError) as info:
        await client.chat.completions.create(model="m", messages=MSG, user="drift")
    assert info.value.status_code == 503
    assert info.value.code == "multimodal_cache_miss"


async def test_sdk_stream_ends_with_the_error_event_not_a_cut() -> None:
    client = client_for(make_app([]))
    stream = await client.chat.completions.create(model="m", messages=MSG, stream=True)
    received: list[str | None] = []
    with pytest.raises(openai.APIError) as info:
        async for chunk in stream:
            received.append(chunk.choices[0].delta.content)
    assert received == ["hi"]
    body: Any = info.value.body
    assert body["code"] == "multimodal_cache_miss"
    assert body["missing_mm_hashes"] == ["h1"]


async def test_sdk_parses_a_normal_response(start_stack: StackFactory) -> None:
    """Through the real chat route (a real P0 on real HTTP, the scripted P1 behind it): the
    SDK parses the whole answer into its types, and what it parsed is what P1 generated."""
    engine, frontend = start_stack()
    assert frontend.state is not None
    core = engine.core
    emitted: dict[str, list[int]] = {}
    prompts: list[list[int]] = []
    add, step = core.add_request, core.step

    def add_request(request: EngineCoreRequest) -> None:
        prompts.append(list(request.prompt_token_ids))
        add(request)

    def stepping() -> list[EngineCoreOutput]:
        outs = step()
        for out in outs:
            emitted.setdefault(out.request_id, []).extend(out.new_token_ids)
        return outs

    core.add_request, core.step = add_request, stepping  # type: ignore[method-assign]
    client = openai.AsyncOpenAI(api_key="k", base_url=frontend.base_url, max_retries=0, timeout=30)
    response = await client.chat.completions.create(model="tiny", messages=MSG, max_tokens=5)
    [prompt], [tokens] = prompts, list(emitted.values())
    assert isinstance(response, ChatCompletion)
    assert response.id.startswith("chatcmpl-") and response.model == "tiny"
    [choice] = response.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert len(tokens) == 5 and choice.message.content == frontend.state.processor.decode(tokens)
    assert choice.message.content  # the scripted tokens decode to ASCII text
    assert response.usage is not None
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt), 5)


def test_frontend_error_overrides() -> None:
    exc = FrontendError("x", param="p", code="c", status=418)
    assert error_status(exc) == 418 and error_body(exc)["error"]["code"] == "c"
