"""Pieces every endpoint shares: request ids, SSE responses, cancelling on disconnect.

Invariants:
- A client that disconnects cancels its handler at once (not at the next chunk): whole
  responses race the work against ``http.disconnect``; :class:`SSEResponse` always listens for
  the disconnect and closes its body iterator, so the generation's ``finally`` aborts the
  request in P1 whatever the ASGI spec version.
- A stream that fails after its first byte ends with the SSE error event and ``[DONE]``
  (:func:`guard_stream`), never with a cut connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from mmis.frontend.errors import SSE_DONE, sse_error_event

log = logging.getLogger(__name__)

T = TypeVar("T")


class ClientGoneError(Exception):
    """The HTTP client disconnected before the response was ready."""


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(http: Request, work: Awaitable[T]) -> T:
    """Run ``work``; cancel it (its ``finally`` aborts P1 work) if the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(http.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher
    if task.cancelled() or not task.done():
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise ClientGoneError("the client disconnected")
    return task.result()


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that stops (and closes its source) on disconnect."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncGenerator[bytes, None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._source = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streamer = asyncio.ensure_future(self._stream(send))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streamer, watcher):
                task.cancel()
            await asyncio.gather(streamer, watcher, return_exceptions=True)
            await self._source.aclose()

    async def _stream(self, send: Send) -> None:
        with contextlib.suppress(OSError):
            await self.stream_response(send)


async def guard_stream(chunks: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
    """Forward ``chunks``; an exception becomes the SSE error event, then ``[DONE]``."""
    try:
        async for chunk in chunks:
            yield chunk
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as exc:
        log.warning("stream failed after its first byte: %s", exc)
        yield sse_error_event(exc)
        yield SSE_DONE
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
