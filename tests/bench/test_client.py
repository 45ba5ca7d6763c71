"""One request of ``mmis bench serve`` (``mmis.bench.client.send``) against canned answers
(httpx's mock transport): which chunks are tokens, where the token count comes from, and how
each kind of failure is reported instead of raised."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from mmis.bench.client import RequestOutput, send

URL = "http://server/v1/chat/completions"
BODY = {"model": "m", "messages": [], "stream": True}


def sse(*events: dict[str, Any]) -> bytes:
    return (
        b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    )


def delta(**fields: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": fields}]}


def run(handler: Any, body: dict[str, Any] = BODY, timeout: float | None = None) -> RequestOutput:
    async def go() -> RequestOutput:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await send(
                http, URL, body, headers={"Authorization": "Bearer k"}, timeout=timeout
            )

    return asyncio.run(go())


def test_role_chunk_is_no_token_and_usage_gives_the_count() -> None:
    seen: dict[str, Any] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["auth"] = request.headers["authorization"]
        content = sse(
            delta(role="assistant"),
            delta(content="he"),
            delta(content="llo\u2028x"),  # raw U+2028 inside the JSON string: not a line break
            delta(content="!"),
            {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 7}},
        )
        return httpx.Response(200, content=content)

    out = run(handler)
    assert out.success and out.status == 200 and seen["auth"] == "Bearer k"
    assert out.generated_text == "hello\u2028x!"
    assert len(out.itl) == 2  # three text chunks: two gaps
    assert (out.output_tokens, out.tokens_from_usage, out.prompt_tokens) == (7, True, 11)
    assert 0 < out.ttft <= out.latency


def test_without_usage_tokens_are_the_text_chunks() -> None:
    out = run(lambda r: httpx.Response(200, content=sse(delta(content="a"), delta(content="b"))))
    assert out.success and (out.output_tokens, out.tokens_from_usage) == (2, False)


def test_http_error_is_counted_with_its_message() -> None:
    error = {"error": {"message": "the model 'x' does not exist", "code": 404}}
    out = run(lambda r: httpx.Response(404, json=error))
    assert not out.success and out.status == 404
    assert out.error == "HTTP 404: the model 'x' does not exist"


def test_stream_without_text_and_error_event_fail() -> None:
    out = run(lambda r: httpx.Response(200, content=sse(delta(role="assistant"))))
    assert not out.success and out.status == 200 and "no generated text" in out.error
    out = run(lambda r: httpx.Response(200, content=sse({"error": {"message": "engine died"}})))
    assert not out.success and out.error == "engine died"


def test_transport_error_and_timeout_never_raise() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    out = run(refuse)
    assert not out.success and out.status is None and out.exception == "ConnectError"

    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(5)
        return httpx.Response(200, content=sse(delta(content="late")))

    out = run(slow, timeout=0.05)
    assert not out.success and out.status is None and out.error.startswith("timeout")


def test_not_streamed_reads_the_message_and_usage() -> None:
    answer = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }
    out = run(lambda r: httpx.Response(200, json=answer), body={"model": "m", "messages": []})
    assert out.success and out.generated_text == "hi" and out.output_tokens == 2
