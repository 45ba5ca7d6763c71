"""What every HTTP request to P0 passes before a handler runs: port, keys, type and size.

:class:`HttpGate` is a pure ASGI middleware, the outermost one of the app
(:mod:`mmis.frontend.api.api_server`), and it decides from the request line and headers alone,
in this order:

1. **Port.** With ``--ops-port`` set, the operations routes (:data:`OPS_PATHS`:
   ``/metrics``, ``/stats/cache``, ``/internal/block_keys``,
   ``/internal/reset_prefix_cache``, ``/internal/load_lora_adapter``,
   ``/internal/unload_lora_adapter``) answer on that port only (404
   on the serving port, after the key check), and that port answers nothing else but the
   probes (404). The operator's Service and Ingress expose the serving port only;
   Prometheus and the operator's coherence probe reach ``/metrics`` and ``/stats/cache`` on
   the operations port pod to pod, without a key. Without ``--ops-port`` all of them live on
   the serving port. One of N P0 processes (``--api-servers``) also listens on a private
   unix socket (``private_socket``) for its siblings: it answers there as on the operations
   port (the operations routes and the probes, no API key), with this process's own figures,
   and :data:`SIBLING_PATHS` (a sibling asking for a uuid binding), which nothing else
   answers (404).
2. **Internal token.** :data:`INTERNAL_PATHS` (``/internal/*``: a router's key request, the
   prefix-cache reset, the operator's LoRA adapter loads and unloads) answer only
   ``Authorization: Bearer <internal token>`` (``--internal-token``, set through
   ``MMIS_FRONTEND_INTERNAL_TOKEN``), on whichever port serves them; the API key neither
   opens them nor is asked for there. A missing or wrong token is 401
   ``invalid_internal_token``; without a configured token they are 403
   ``internal_routes_disabled``. Compared in constant time.
3. **API key.** With ``--api-key`` (one key or several, separated by commas), every other
   path of the serving port but :data:`OPEN_PATHS` (``/health``, ``/ready``: kubelet carries
   no key) needs ``Authorization: Bearer <key>``: API docs, ``/v1/models`` and unknown paths
   included. The scheme is case-insensitive (as HTTP allows), the key is compared in
   constant time against every configured key; a failure is 401 ``invalid_api_key``.
   Tokens and keys are checked before any body byte is read, so an unauthenticated client
   cannot make P0 read (or hold) a body.
4. **Tenant.** A request that passes gets its tenant (:mod:`mmis.frontend.client.tenancy`)
   in its scope (:func:`tenant_of`): the ``--tenant-header`` value when that setting names a
   header the request carries, else the digest of the API key it presented, else the one
   anonymous tenant when the server has no keys. An ``/internal/*`` request with keys
   configured and no tenant header names none (``None``): its ``Authorization`` is the
   internal token.
5. **Content type.** A ``POST`` (``PUT``, ``PATCH``) body must be JSON: a ``Content-Type``
   other than ``application/json`` (or a ``+json`` type) is 415; none at all is read as
   JSON.
6. **Body size.** At most ``--max-request-body-mb``. A ``Content-Length`` beyond it is
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

from mmis.frontend.client.tenancy import ANONYMOUS, header_tenant, key_tenant
from mmis.frontend.errors import (
    PERMISSION_TYPE,
    FrontendError,
    RequestTooLargeError,
    UnsupportedMediaTypeError,
    error_body,
    error_status,
)

INTERNAL_PATHS = frozenset(
    {
        "/internal/block_keys",
        "/internal/reset_prefix_cache",
        "/internal/load_lora_adapter",  # the operator's adapter sync (api/lora_routes.py)
        "/internal/unload_lora_adapter",
    }
)
OPS_PATHS = frozenset({"/metrics", "/stats/cache"}) | INTERNAL_PATHS
OPEN_PATHS = frozenset({"/health", "/ready"})  # kubelet's probes carry no key
SIBLING_PATHS = frozenset({"/sibling/uuid_binding"})  # one P0 of N asks another, privately
TENANT_SCOPE_KEY = "mmis.tenant"  # where the gate leaves a request's tenant (tenant_of)
INTERNAL_TOKEN_ENV = "MMIS_FRONTEND_INTERNAL_TOKEN"
DRAIN_FACTOR = 4
DRAIN_SECONDS = 5.0
MiB = 1 << 20


class UnauthorizedError(FrontendError):
    status = 401
    code = "invalid_api_key"


class InvalidInternalTokenError(FrontendError):
    status = 401
    code = "invalid_internal_token"


class InternalRoutesDisabledError(FrontendError):
    status = 403
    type = PERMISSION_TYPE
    code = "internal_routes_disabled"


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


def tenant_of(scope: Scope) -> str | None:
    """The tenant the gate named for this request (``None``: none can be named)."""
    tenant: str | None = scope.get(TENANT_SCOPE_KEY, ANONYMOUS)
    return tenant


def _matches(token: str | None, expected: Iterable[bytes]) -> bytes | None:
    """The expected value ``token`` equals (each compared in constant time), or ``None``."""
    given = (token or "").encode("utf-8", "surrogateescape")
    found: bytes | None = None
    for candidate in expected:  # no early exit: the time does not say which one matched
        if hmac.compare_digest(given, candidate) and token is not None:
            found = candidate
    return found


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
        api_keys: Iterable[str] = (),
        max_body_bytes: int,
        ops_port: int | None = None,
        internal_token: str | None = None,
        tenant_header: str | None = None,
        private_socket: str | None = None,
    ) -> None:
        self.app = app
        self.private_socket = private_socket
        # key bytes -> tenant id (a digest: the key itself is never a tenant's name)
        self.keys = {k.encode(): key_tenant(k) for k in api_keys if k}
        self.internal = internal_token.encode() if internal_token else None
        self.tenant_header = tenant_header.lower().encode() if tenant_header else None
        self.max_body_bytes = max_body_bytes
        self.ops_port = ops_port
        self._wanted: tuple[bytes, ...] = (b"authorization", b"content-type", b"content-length")
        if self.tenant_header is not None:
            self._wanted += (self.tenant_header,)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope, self._wanted)
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
        """Why the request is refused (``None``: it passes, its tenant now in its scope)."""
        path: str = scope["path"]
        server = scope.get("server") or (None, None)
        on_ops = self.ops_port is not None and server[1] == self.ops_port
        # a unix socket's scope["server"] is (its path, None): the siblings' private socket
        on_private = (
            self.private_socket is not None
            and server[1] is None
            and server[0] == self.private_socket
        )
        on_ops = on_ops or on_private
        key_tenant_id: str | None = None
        if path in SIBLING_PATHS:  # no key: only the pod's own processes reach that socket
            return None if on_private else NotFoundError(f"{path} is not served here")
        if on_ops and path not in OPS_PATHS:
            if path in OPEN_PATHS:
                return None
            return NotFoundError(f"{path} is not served on the operations port")
        if path in INTERNAL_PATHS and (on_ops or self.ops_port is None):
            refusal = self._internal_refusal(headers)
            if refusal is not None:
                return refusal
        elif on_ops:
            return None  # /metrics, /stats/cache: scrapers and the operator, no key
        elif self.keys and path not in OPEN_PATHS:
            given = headers.get(b"authorization", "")
            if not given:
                return UnauthorizedError("missing API key: send 'Authorization: Bearer <key>'")
            key = _matches(bearer_token(given), self.keys)
            if key is None:
                return UnauthorizedError("invalid API key")
            key_tenant_id = self.keys[key]
        if self.ops_port is not None and path in OPS_PATHS and not on_ops:
            return NotFoundError(f"{path} is served on the operations port (--ops-port)")
        scope[TENANT_SCOPE_KEY] = self._tenant(headers, key_tenant_id)
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

    def _internal_refusal(self, headers: dict[bytes, str]) -> FrontendError | None:
        """``/internal/*``: the internal token, and nothing else, opens it."""
        if self.internal is None:
            return InternalRoutesDisabledError(
                "the internal routes are disabled: this server has no internal token (set "
                f"{INTERNAL_TOKEN_ENV})"
            )
        given = headers.get(b"authorization", "")
        if not given:
            return InvalidInternalTokenError(
                "missing internal token: send 'Authorization: Bearer <internal token>'"
            )
        if _matches(bearer_token(given), (self.internal,)) is None:
            return InvalidInternalTokenError("invalid internal token")
        return None

    def _tenant(self, headers: dict[bytes, str], key_tenant_id: str | None) -> str | None:
        """The request's tenant: the tenant header, else its API key, else the anonymous one
        (``None`` when the server has keys and the request presented none)."""
        if self.tenant_header is not None:
            value = headers.get(self.tenant_header, "").strip()
            if value:
                return header_tenant(value)
        if key_tenant_id is not None:
            return key_tenant_id
        return None if self.keys else ANONYMOUS

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
        challenge = isinstance(exc, UnauthorizedError | InvalidInternalTokenError)
        headers = {"WWW-Authenticate": "Bearer"} if challenge else None
        response = JSONResponse(error_body(exc), status_code=error_status(exc), headers=headers)
        await response(scope, receive, send)
