"""What every HTTP request to P0 passes before a handler runs: port, key, type and size.

:class:`HttpGate` is a pure ASGI middleware, the outermost one of the app
(:mod:`mmis.frontend.api.api_server`), and it decides from the request line and headers alone,
in this order:

1. **Port.** With ``--ops-port`` set, the operations routes (:data:`OPS_PATHS`:
   ``/metrics``, ``/stats/cache``, ``/internal/block_keys``,
   ``/internal/reset_prefix_cache``) answer on that port only (404
   on the serving port, after the key check), and that port answers nothing else but the
   probes (404). The operator's Service and Ingress expose the serving port only;
   Prometheus, the operator's coherence probe and routers reach the operations port pod
   to pod, without a key. Without ``--ops-port`` both live on the serving port.
2. **API key.** With ``--api-key``, every path of the serving port but :data:`OPEN_PATHS`
   (``/health``, ``/ready``: kubelet carries no key) needs
   ``Authorization: Bearer <key>``: API docs, ``/v1/models`` and unknown paths included.
   The scheme is case-insensitive (as HTTP allows), the key is compared in constant time;
   a failure is 401 ``invalid_api_key``. Checked before any body byte is read, so an
   unauthenticated client cannot make P0 read (or hold) a body.
3. **Content type.** A ``POST`` (``PUT``, ``PATCH``) body must be JSON: a ``Content-Type``
   other than ``application/json`` (or a ``+json`` type) is 415; none at all is read as
   JSON.
4. **Body size.** At most ``--max-request-body-mb``. A ``Content-Length`` beyond it is
   refused before the body is read; a body without one (chunked) is counted while the
   handler reads it and refused the moment it passes the limit. Either way the answer is
   413 ``request_too_large`` and P0 holds at most ``limit`` bytes of it.

Invariants:
- Every refusal is the OpenAI error shape (:mod:`mmis.frontend.errors`) and no handler
  runs for it.
- A refused body is read and discarded (never kept) up to :data:`DRAIN_FACTOR` times the
  limit or :data:`DRAIN_SECONDS`, before answering: a client still uploading when the
  connection closes would see a reset instead of the 413. Past those bounds the 413 goes
  out at once and the connection closes.
- Cheap on the normal path: a dictionary lookup per header of interest, and a length sum
  per body chunk.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Iterable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mmis.frontend.errors import (
    FrontendError,
    RequestTooLargeError,
    UnsupportedMediaTypeError,
    error_body,
    error_status,
)

OPS_PATHS = frozenset(
    {"/metrics", "/stats/cache", "/internal/block_keys", "/internal/reset_prefix_cache"}
)
OPEN_PATHS = frozenset({"/health", "/ready"})  # kubelet's probes carry no key
DRAIN_FACTOR = 4
DRAIN_SECONDS = 5.0
MiB = 1 << 20


class UnauthorizedError(FrontendError):
    status = 401
    code = "invalid_api_key"


class NotFoundError(FrontendError):
    status = 404
    code = "not_found"


def is_json(content_type: str) -> bool:
    """``application/json`` or any ``+json`` type, parameters (``charset``) ignored."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def bearer_token(authorization: str) -> str | None:
    """The token of ``Bearer <token>`` (scheme in any case), or ``None``."""
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def _headers(scope: Scope, names: Iterable[bytes]) -> dict[bytes, str]:
    wanted = set(names)
    found: dict[bytes, str] = {}
    for key, value in scope.get("headers", ()):
        low = key.lower()
        if low in wanted and low not in found:
            found[low] = value.decode("latin-1")
    return found


class HttpGate:
    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        max_body_bytes: int,
        ops_port: int | None = None,
    ) -> None:
        self.app = app
        self.expected = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.ops_port = ops_port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope, (b"authorization", b"content-type", b"content-length"))
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            length = headers.get(b"content-length", "").strip()
            small = not length.isdigit() or int(length) <= DRAIN_FACTOR * self.max_body_bytes
            drain = scope["method"] in ("POST", "PUT", "PATCH") and small
            await self._answer(refusal, scope, receive, send, drain=drain)
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        await self.app(scope, self._counting(receive), send)

    def _refusal(self, scope: Scope, headers: dict[bytes, str]) -> FrontendError | None:
        path: str = scope["path"]
        server = scope.get("server") or (None, None)
        if self.ops_port is not None and server[1] == self.ops_port:
            if path in OPS_PATHS or path in OPEN_PATHS:
                return None
            return NotFoundError(f"{path} is not served on the operations port")
        if self.expected is not None and path not in OPEN_PATHS:
            given = headers.get(b"authorization", "")
            if not given:
                return UnauthorizedError("missing API key: send 'Authorization: Bearer <key>'")
            token = bearer_token(given)
            if token is None or not hmac.compare_digest(token.encode(), self.expected):
                return UnauthorizedError("invalid API key")
        if self.ops_port is not None and path in OPS_PATHS:
            return NotFoundError(f"{path} is served on the operations port (--ops-port)")
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return None
        content_type = headers.get(b"content-type")
        if content_type is not None and not is_json(content_type):
            return UnsupportedMediaTypeError(
                f"the request body must be JSON (Content-Type: application/json), "
                f"got {content_type!r}"
            )
        length = headers.get(b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_body_bytes:
            return self._too_large(f"{int(length)} bytes")
        return None

    def _too_large(self, what: str) -> RequestTooLargeError:
        limit = self.max_body_bytes / MiB
        return RequestTooLargeError(
            f"the request body ({what}) is larger than this server accepts ({limit:g} MiB; "
            "raise it with --max-request-body-mb)"
        )

    def _counting(self, receive: Receive) -> Receive:
        """``receive`` that raises :class:`RequestTooLargeError` once the body passes the
        limit, after discarding the rest (within the drain bounds)."""
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    if message.get("more_body", False):
                        await self._drain(receive, seen)
                    raise self._too_large(f"more than {self.max_body_bytes} bytes")
            return message

        return counted

    async def _drain(self, receive: Receive, seen: int) -> None:
        """Read and drop the rest of a refused body, within the drain bounds."""
        cap = DRAIN_FACTOR * self.max_body_bytes
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_SECONDS
        while seen <= cap:
            left = deadline - loop.time()
            if left <= 0:
                return
            try:
                message = await asyncio.wait_for(receive(), left)
            except TimeoutError:
                return
            if message["type"] != "http.request":
                return
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    async def _answer(
        self, exc: FrontendError, scope: Scope, receive: Receive, send: Send, *, drain: bool
    ) -> None:
        if drain:
            await self._drain(receive, 0)
        headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, UnauthorizedError) else None
        response = JSONResponse(error_body(exc), status_code=error_status(exc), headers=headers)
        await response(scope, receive, send)
