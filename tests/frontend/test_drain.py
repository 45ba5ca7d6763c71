"""P0's drain (``mmis.frontend.api.drain``) on toy ASGI apps: what each request gets once
the drain began, and how in-flight work is ended at the deadline.

The real processes under a pod's termination are ``tests/security/test_termination.py``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from mmis.frontend.api.drain import END_MARGIN_S, Drain, DrainMiddleware

SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]


def _scope(method: str = "POST", path: str = "/v1/chat/completions") -> Scope:
    return {"type": "http", "method": method, "path": path, "headers": [], "query_string": b""}


async def _call(app: Any, scope: Scope) -> list[Message]:
    sent: list[Message] = []
    body_read = False

    async def receive() -> Message:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await asyncio.Event().wait()  # no disconnect
        raise AssertionError

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def _status(sent: list[Message]) -> int:
    return int(sent[0]["status"])


def _headers(sent: list[Message]) -> dict[bytes, bytes]:
    return dict(sent[0]["headers"])


def _body(sent: list[Message]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def _error(body: bytes) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(body)["error"]
    return error


async def _ok(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok", "more_body": False})


class Hanging:
    """An app that starts its answer (or not) and then waits forever: work past the grace."""

    def __init__(self, *, stream: bool) -> None:
        self.stream = stream
        self.entered = asyncio.Event()
        self.cancelled = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.stream:
            await send({"type": "http.response.start", "status": 200, "headers": SSE})
            await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        self.entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True  # the handler's finally would abort its engine requests here
            raise


async def test_before_the_signal_requests_pass_through() -> None:
    drain = Drain(grace_s=30)
    sent = await _call(DrainMiddleware(_ok, drain=drain), _scope())
    assert (_status(sent), _body(sent)) == (200, b"ok")
    assert not drain.tick()  # not draining: the server keeps going


async def test_after_the_signal_new_work_gets_the_retryable_503_and_reads_stay_open() -> None:
    drain = Drain(grace_s=30)
    app = DrainMiddleware(_ok, drain=drain)
    drain.begin()
    sent = await _call(app, _scope())
    assert _status(sent) == 503
    headers = _headers(sent)
    assert headers[b"retry-after"] == b"1" and headers[b"connection"] == b"close"
    assert headers[b"content-type"] == b"application/json"
    error = _error(_body(sent))
    assert (error["code"], error["retryable"], error["type"]) == (
        "server_shutting_down",
        True,
        "service_unavailable_error",
    )
    # probes, metrics and the ops routes keep answering while P0 drains
    for scope in (_scope("GET", "/health"), _scope("GET", "/v1/models")):
        assert _status(await _call(app, scope)) == 200
    assert _status(await _call(app, _scope("POST", "/internal/block_keys"))) == 200
    assert drain.tick()  # nothing in flight: the server may stop


async def test_work_in_flight_at_the_deadline_ends_with_the_503() -> None:
    drain = Drain(grace_s=0.4)  # ends the late work at grace/2 (the margin is 1 s)
    app = Hanging(stream=False)
    call = asyncio.ensure_future(_call(DrainMiddleware(app, drain=drain), _scope()))
    await app.entered.wait()
    drain.begin()
    assert not drain.tick()  # before the deadline (0.2 s on): it runs on
    await asyncio.sleep(0.3)  # past the deadline: the next tick ends it
    assert not drain.tick()  # ended, not yet gone
    sent = await asyncio.wait_for(call, 5)
    assert app.cancelled
    assert _status(sent) == 503 and _error(_body(sent))["code"] == "server_shutting_down"
    assert drain.tick()


async def test_a_stream_in_flight_at_the_deadline_ends_with_the_sse_error_event() -> None:
    drain = Drain(grace_s=0.2)
    app = Hanging(stream=True)
    call = asyncio.ensure_future(_call(DrainMiddleware(app, drain=drain), _scope()))
    await app.entered.wait()
    drain.begin()
    await asyncio.sleep(0.2)  # past the deadline (0.1 s on)
    drain.tick()
    sent = await asyncio.wait_for(call, 5)
    assert _status(sent) == 200 and app.cancelled
    events = _body(sent).decode().split("\n\n")
    assert events[0] == "data: {}" and events[2] == "data: [DONE]"
    error = _error(events[1].removeprefix("data: ").encode())
    assert (error["code"], error["retryable"]) == ("server_shutting_down", True)
    assert sent[-1]["more_body"] is False


def test_the_deadline_is_a_margin_before_the_grace() -> None:
    drain = Drain(grace_s=30)
    assert drain.end_at is None
    drain.begin()
    assert drain.since is not None and drain.end_at == drain.since + 30 - END_MARGIN_S
    short = Drain(grace_s=1)
    short.begin()
    assert short.since is not None and short.end_at == short.since + 0.5
