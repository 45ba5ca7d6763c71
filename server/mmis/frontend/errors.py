"""Typed front-end errors and their mapping to HTTP responses in the OpenAI error shape.

Every error a client can see leaves P0 as ``{"error": {"message", "type", "param", "code"}}``
(plus documented extra keys inside ``error``). The mapping:

============================================  ======  =========================================
error                                         status  ``code``
============================================  ======  =========================================
:class:`InvalidRequestError` (schema)         400     ``invalid_request`` (``param`` named)
:class:`InvalidMediaError` (bad image)        400     ``invalid_image``
:class:`MediaTooLargeError` (bytes, pixels)   400     ``media_too_large``
:class:`TooManyImagesError`                   400     ``too_many_images``
:class:`MediaFetchError` (remote fetch)       400     ``media_fetch_failed``
:class:`MediaForbiddenError` (SSRF, file://)  403     ``media_forbidden``
:class:`ContextLengthExceededError`           400     ``context_length_exceeded``
:class:`HashOnlyCacheMissError`               422     ``multimodal_cache_miss``
:class:`ModelNotFoundError` (``model``)       404     ``model_not_found``
LoRA adapters (``frontend/client/lora.py``):  400     ``invalid_request`` (cannot be loaded),
load / unload / an unknown adapter            404     ``model_not_found``,
(switched on the engine's codes, never on     409     ``lora_adapter_in_use`` (unload),
its texts: ``lora_in_use``, ...)                      ``lora_already_loaded`` (an internal
                                                      load of a name held from another path)
a request's adapter the engine refused as     400     its own ``code`` (P0 first looks the
``lora_not_loaded`` / ``lora_id_mismatch``            adapter up again and sends the request
                                                      once more, else answers the 404:
                                                      ``api/serving_generate.py``)
:class:`RequestTooLargeError` (body size)     413     ``request_too_large``
:class:`UnsupportedMediaTypeError`            415     ``unsupported_media_type``
:class:`~mmis.protocol.errors.MultiModalCacheMissError` (after the one retry)
                                              503     ``multimodal_cache_miss``
other :class:`MMISError` coded invalid_request / context_length_exceeded (e.g. ProtocolError)
                                              400     its own ``code``
any other :class:`MMISError` / exception      500     ``internal_error`` (text not leaked)
============================================  ======  =========================================

Why 422 for hash-only misses: the request is well formed, but it names items (by ``uuid``)
that the engine no longer holds, so it cannot be processed as sent. The client heals it by
resending the same request *with the image data*; resending it unchanged cannot help, which is
why it is not 409/429/5xx (the OpenAI SDKs retry those automatically, pointlessly).
The body carries ``"retryable": true`` and ``"missing_uuids": [...]``.

The 503 for a miss after the retry carries ``"retryable": true`` and ``"missing_mm_hashes"``.

:class:`EngineUnavailableError` (P1 down, restarting or hung; 503, ``engine_unavailable``) and
its subclasses ``EngineRestartedError`` (``frontend/client/generation.py``,
``engine_restarted``) and :class:`ServerShuttingDownError` (P0 is draining after SIGTERM,
``server_shutting_down``) carry ``"retryable": true`` and a ``Retry-After`` header
(:func:`json_response`).

Streams that already sent bytes cannot change their status: they end with
:func:`sse_error_event` (``data: {"error": {...}}``, the event the OpenAI SDK raises on),
followed by :data:`SSE_DONE`. FastAPI wiring (validation errors included) is
:func:`mmis.frontend.api.schemas.install_exception_handlers`.

Invariant: the message of every error is written for the client; internal errors never leak
their exception text (only a generic message), the rest always name what was wrong.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from fastapi.responses import JSONResponse

from mmis.protocol.errors import MMISError, MultiModalCacheMissError
from mmis.protocol.messages import ErrorCode, RequestError

INVALID_REQUEST_TYPE = "invalid_request_error"
PERMISSION_TYPE = "permission_error"
SERVER_TYPE = "server_error"
UNAVAILABLE_TYPE = "service_unavailable_error"

SSE_DONE = b"data: [DONE]\n\n"


class FrontendError(MMISError):
    """An error with everything needed to answer the client: status, type, code, param."""

    status: int = 400
    type: str = INVALID_REQUEST_TYPE
    code: str = ErrorCode.INVALID_REQUEST.value

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status

    def extra(self) -> dict[str, Any]:
        """Extra keys placed inside the ``error`` object (documented per subclass)."""
        return {}


class InvalidRequestError(FrontendError):
    """A request that fails schema or range validation; ``param`` names the field."""


class ContextLengthExceededError(FrontendError):
    code = ErrorCode.CONTEXT_LENGTH_EXCEEDED.value


class MediaError(FrontendError):
    """Base of every error raised while loading or decoding an image."""

    code = "invalid_image"


class InvalidMediaError(MediaError):
    """Broken base64, a non-image, a truncated or corrupt image, a bad URL."""


class MediaTooLargeError(MediaError):
    code = "media_too_large"


class TooManyImagesError(MediaError):
    code = "too_many_images"


class MediaFetchError(MediaError):
    """A remote fetch that failed: unreachable, timed out, non-200, too many redirects."""

    code = "media_fetch_failed"


class MediaForbiddenError(MediaError):
    """A URL refused by policy: a private address (SSRF guard) or a path outside the root."""

    status = 403
    type = PERMISSION_TYPE
    code = "media_forbidden"


class HashOnlyCacheMissError(FrontendError):
    """Items named only by ``uuid`` that the engine no longer holds; resend them with data."""

    status = 422
    code = ErrorCode.MULTIMODAL_CACHE_MISS.value
    retryable = True

    def __init__(self, missing_uuids: Iterable[str], *, param: str | None = "messages") -> None:
        self.missing_uuids = list(dict.fromkeys(missing_uuids))
        super().__init__(
            f"{len(self.missing_uuids)} image(s) sent by uuid only are no longer cached by the "
            f"server: {', '.join(self.missing_uuids)}; resend them with their image data",
            param=param,
        )

    def extra(self) -> dict[str, Any]:
        return {"retryable": True, "missing_uuids": self.missing_uuids}


class ModelNotFoundError(FrontendError):
    """The request names a model this server does not serve (``--served-model-name``)."""

    status = 404
    code = "model_not_found"

    def __init__(self, model: str, served: Iterable[str]) -> None:
        names = ", ".join(repr(name) for name in served)
        super().__init__(
            f"the model {model!r} does not exist on this server; it serves {names}",
            param="model",
        )


class RequestTooLargeError(FrontendError):
    """The body is larger than ``--max-request-body-mb`` (refused while reading it)."""

    status = 413
    code = "request_too_large"


class UnsupportedMediaTypeError(FrontendError):
    """A body sent with a ``Content-Type`` other than JSON."""

    status = 415
    code = "unsupported_media_type"


def error_status(exc: BaseException) -> int:
    if isinstance(exc, FrontendError):
        return exc.status
    if isinstance(exc, MultiModalCacheMissError):
        return 503
    if isinstance(exc, MMISError) and exc.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED.value:
        return 400
    if isinstance(exc, MMISError) and exc.code == ErrorCode.INVALID_REQUEST.value:
        return 400
    return 500


def error_body(exc: BaseException) -> dict[str, Any]:
    """The OpenAI-shaped JSON body for ``exc``."""
    status = error_status(exc)
    error: dict[str, Any]
    if isinstance(exc, FrontendError):
        error = {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}
        error.update(exc.extra())
    elif isinstance(exc, MultiModalCacheMissError):
        error = {
            "message": f"{exc} (the retry missed too; try again)",
            "type": UNAVAILABLE_TYPE,
            "param": None,
            "code": exc.code,
            "retryable": True,
            "missing_mm_hashes": exc.mm_hashes,
        }
    elif isinstance(exc, MMISError) and status == 400:
        error = {"message": str(exc), "type": INVALID_REQUEST_TYPE, "param": None, "code": exc.code}
    else:
        error = {
            "message": "internal server error",
            "type": SERVER_TYPE,
            "param": None,
            "code": ErrorCode.INTERNAL.value,
        }
    return {"error": error}


STALE_LORA_CODES = frozenset({ErrorCode.LORA_NOT_LOADED.value, ErrorCode.LORA_ID_MISMATCH.value})
"""The engine's refusals of a request's LoRA adapter that a fresh look-up of it may heal."""


def from_request_error(
    error: RequestError, missing_mm_hashes: Iterable[str] = ()
) -> MMISError | FrontendError:
    """Turn a wire :class:`RequestError` from P1 into the typed exception P0 raises.

    A ``multimodal_cache_miss`` becomes :class:`MultiModalCacheMissError` (the endpoint retries
    it once; if it reaches :func:`error_body` it is the 503). Unknown codes are internal errors.
    An ``invalid_request`` error keeps the ``param`` P1 named (e.g. the field that carried a
    structured-output constraint that did not compile). A LoRA adapter the engine does not hold
    (``lora_not_loaded``) or holds under another id (``lora_id_mismatch``) is a 400 keeping
    that code, which ``api/serving_generate.py`` switches on.
    """
    if error.code == ErrorCode.MULTIMODAL_CACHE_MISS.value:
        return MultiModalCacheMissError(missing_mm_hashes)
    if error.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED.value:
        return ContextLengthExceededError(error.message, param="messages")
    if error.code == ErrorCode.INVALID_REQUEST.value:
        return InvalidRequestError(error.message, param=error.param)
    if error.code in STALE_LORA_CODES:  # the request's ``model`` names an adapter P0 knows stale
        return InvalidRequestError(error.message, param="model", code=error.code)
    internal = MMISError(error.message)
    internal.code = ErrorCode.INTERNAL.value
    return internal


def sse_error_event(exc: BaseException) -> bytes:
    """The SSE event that ends a stream which already sent bytes (send :data:`SSE_DONE` next)."""
    body = error_body(exc)
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def json_response(exc: BaseException) -> JSONResponse:
    headers = exc.headers() if isinstance(exc, EngineUnavailableError) else None
    return JSONResponse(error_body(exc), status_code=error_status(exc), headers=headers)


class EngineUnavailableError(FrontendError):
    """P1 is down, restarting or not answering (503, ``engine_unavailable``, retryable).

    The response carries ``Retry-After`` (:attr:`retry_after_s`, whole seconds, at least 1) so
    a gateway or client retries later, on this replica or another one; the body says
    ``"retryable": true``. A stream that already sent bytes gets the same error as its SSE
    error event. Raised by ``frontend/client/engine_client.py``,
    ``frontend/client/engine_liveness.py`` and ``frontend/client/recovery.py``.
    """

    status = 503
    type = UNAVAILABLE_TYPE
    code = ErrorCode.ENGINE_UNAVAILABLE.value
    retryable = True

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = max(1, math.ceil(retry_after_s))

    def extra(self) -> dict[str, Any]:
        return {"retryable": True}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class ServerShuttingDownError(EngineUnavailableError):
    """P0 got SIGTERM (503, ``server_shutting_down``, retryable, ``Retry-After``).

    A request that arrives while P0 drains, or one still running when the drain's deadline
    comes, gets it (:mod:`mmis.frontend.api.drain`): send it again, another replica (or this
    one, restarted) answers it. A stream that already sent bytes ends with it as its SSE error
    event.
    """

    code = "server_shutting_down"
