"""P0's drain after SIGTERM: new work gets a retryable 503, in-flight work ends cleanly.

:class:`Drain` is the state, one per app; ``mmis frontend`` (``entrypoints/frontend.py``)
starts it when the process gets SIGTERM or SIGINT and asks it on every server tick whether
anything is left. :class:`DrainMiddleware`, a pure ASGI middleware inside the HTTP gate and
the request telemetry (:mod:`mmis.frontend.api.api_server`), applies it to every *work*
request: a ``POST`` outside the operations routes (the ones that render, tokenize or
generate). The ``GET`` routes (probes, ``/metrics``, ``/v1/models``) answer throughout;
``/ready`` says ``draining`` (503).

Invariants:
- Before the signal a work request only runs as a task of its own (so that it can be ended).
- From the signal on (:meth:`Drain.begin`: attribute writes only, safe in a signal handler)
  every new work request, on a new or a kept-alive connection, is answered at once with 503
  :class:`~mmis.frontend.errors.ServerShuttingDownError` (``server_shutting_down``,
  ``retryable: true``, ``Retry-After``) and ``Connection: close``, after its body was read
  and dropped (within :data:`DISCARD_S`, so the client sees the answer, not a reset).
- Work in flight at the signal runs on until it ends, or until :attr:`Drain.end_at`
  (``grace_s`` after the signal, less :data:`END_MARGIN_S`), when P0 ends it itself
  (:meth:`Drain.tick`): its handler is cancelled, which aborts its engine requests, and a
  response not yet started becomes that same 503; a stream that already sent bytes ends with
  the retryable SSE error event and ``[DONE]``. uvicorn's own deadline, which would cancel it
  into a plain-text ``500 Internal Server Error`` or a cut stream, is never reached.
- :meth:`Drain.tick` is true once the drain began and no work is in flight: the server then
  stops (closing its listeners and idle connections) and the lifespan closes the state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mmis.frontend.api.http_gate import OPS_PATHS
from mmis.frontend.errors import SSE_DONE, ServerShuttingDownError, error_body, sse_error_event

log = logging.getLogger(__name__)

END_MARGIN_S = 1.0
"""How long before the drain's end P0 ends the work still in flight (at most half the grace)."""
DISCARD_S = 2.0
"""The longest a refused request's body is read (and dropped) before the 503 goes out."""
WORK_METHODS = frozenset({"POST", "PUT", "PATCH"})


def shutting_down() -> ServerShuttingDownError:
    return ServerShuttingDownError(
        "the server is shutting down; send the request again (another replica answers it)"
    )


def is_work(scope: Scope) -> bool:
    """Whether the drain governs this request: a body-carrying method off the ops routes."""
    return (
        scope["type"] == "http"
        and scope["method"] in WORK_METHODS
        and (scope["path"] not in OPS_PATHS)
    )


class Drain:
    """The drain of one app: whether it began, its deadline, and the work in flight."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.since: float | None = None  # time.monotonic() of the signal
        self._inflight: set[asyncio.Future[None]] = set()
        self._ended: set[asyncio.Future[None]] = set()
        self._announced = False

    @property
    def draining(self) -> bool:
        return self.since is not None

    @property
    def end_at(self) -> float | None:
        """When the work still in flight is ended (monotonic clock); None before the signal."""
        if self.since is None:
            return None
        return self.since + max(self.grace_s - END_MARGIN_S, self.grace_s / 2)

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def begin(self) -> None:
        """Start draining (idempotent). Called from a signal handler: it only sets a field."""
        if self.since is None:
            self.since = time.monotonic()

    def tick(self) -> bool:
        """On the event loop, every server tick: end the work past :attr:`end_at`; whether
        the drain began and nothing is left in flight."""
        end_at = self.end_at
        if end_at is None:
            return False
        if not self._announced:
            self._announced = True
            log.info(
                "draining: %d request(s) in flight may run %.1fs more; new ones get 503 %s",
                len(self._inflight),
                max(0.0, end_at - time.monotonic()),
                ServerShuttingDownError.code,
            )
        late = self._inflight - self._ended if time.monotonic() >= end_at else set()
        if late:
            log.warning("drain deadline: ending %d request(s) with a retryable 503", len(late))
        for task in late:
            self._ended.add(task)
            task.cancel("the drain's deadline")
        return not self._inflight

    def _track(self, task: asyncio.Future[None]) -> None:
        self._inflight.add(task)

    def _untrack(self, task: asyncio.Future[None]) -> bool:
        """Forget ``task``; whether the drain ended it."""
        self._inflight.discard(task)
        ended = task in self._ended
        self._ended.discard(task)
        return ended


class _Watched:
    """``send`` that remembers how far the response got."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.complete = False
        self.sse = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            for key, value in message.get("headers", ()):
                if key.lower() == b"content-type":
                    self.sse = value.lower().startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self._send(message)

    async def end(self, scope: Scope, receive: Receive) -> None:
        """Finish a response the drain cut short: the 503 if nothing was sent, the SSE error
        event if a stream was, nothing if it was complete."""
        if not self.started:
            await _answer_503(scope, receive, self._send, discard=False)
        elif not self.complete:
            body = sse_error_event(shutting_down()) + SSE_DONE if self.sse else b""
            with contextlib.suppress(OSError, RuntimeError):
                await self._send({"type": "http.response.body", "body": body, "more_body": False})


async def _discard_body(receive: Receive) -> None:
    """Read and drop what is left of the request body, for at most :data:`DISCARD_S`."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(DISCARD_S):
            while True:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return


async def _answer_503(scope: Scope, receive: Receive, send: Send, *, discard: bool) -> None:
    if discard:
        await _discard_body(receive)
    exc = shutting_down()
    headers = {**exc.headers(), "Connection": "close"}  # the client reconnects (elsewhere)
    response = JSONResponse(error_body(exc), status_code=exc.status, headers=headers)
    with contextlib.suppress(OSError, RuntimeError):
        await response(scope, receive, send)


class DrainMiddleware:
    """Applies :class:`Drain` to every work request (:func:`is_work`)."""

    def __init__(self, app: ASGIApp, *, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not is_work(scope):
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await _answer_503(scope, receive, send, discard=True)
            return
        watched = _Watched(send)
        task = asyncio.ensure_future(self.app(scope, receive, watched.send))
        self.drain._track(task)
        try:
            await task  # a cancellation of this request (uvicorn's) cancels ``task`` too
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not task.cancelled() or (current is not None and current.cancelling()):
                raise  # not ours: the server's own cancellation
        finally:
            ended = self.drain._untrack(task)
        if ended:
            await watched.end(scope, receive)
