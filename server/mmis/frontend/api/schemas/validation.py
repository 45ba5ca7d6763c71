"""Parse a raw request body into a request model, or raise a typed 400.

Invariants:
- Every way a body can be wrong (not JSON, not an object, a schema or range error) ends as
  :class:`~mmis.frontend.errors.InvalidRequestError` whose ``param`` names the first
  offending field, never a pydantic exception escaping to the client — both through
  :func:`parse_request` and through FastAPI's own body validation once
  :func:`install_exception_handlers` is applied to the app.
- Text the server cannot encode is refused here, before anything is loaded or rendered: a
  lone surrogate (``"\\ud800"`` is a valid JSON escape, and Python's JSON decoder also passes
  surrogates written as raw bytes) anywhere in the body — a key or a string value: message
  text, ``stop``, a prompt, tool definitions, ``response_format``, Responses input, uuids —
  is a 400 naming the field and the character's position (:func:`find_lone_surrogate`). The
  tokenizer, the processor and the wire codec (UTF-8 only) could not take it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from mmis.frontend.api.schemas.sampling import DEFAULT_MAX_N, context_for
from mmis.frontend.errors import InvalidRequestError, json_response
from mmis.protocol.errors import MMISError

M = TypeVar("M", bound=BaseModel)

_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
_SURROGATE = re.compile("[\ud800-\udfff]")


def _is_union_tag(part: str) -> bool:
    """Union-branch labels pydantic puts in ``loc`` (``str``, ``list[part]``, ...)."""
    return part in _TYPE_TAGS or "[" in part


def _param_from_loc(loc: Iterable[int | str]) -> str | None:
    """``("body", "messages", 0, "content", "list[part]", 1)`` -> ``"messages[0].content[1]"``."""
    text = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            text += f"[{part}]"
        elif (i == 0 and part == "body") or _is_union_tag(part):
            continue
        else:
            text += f".{part}" if text else part
    return text or None


def _clean(msg: str) -> str:
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix) :]
    return msg


def invalid_request_from_validation(errors: Iterable[Any]) -> InvalidRequestError:
    """Build one 400 from pydantic-style validation errors (dicts with ``loc`` and ``msg``).

    ``param`` names the first offending field; the message names it too and counts the rest.
    """
    items = [e for e in errors if isinstance(e, dict)]
    if not items:
        return InvalidRequestError("invalid request body")
    first = items[0]
    if first.get("type") == "json_invalid":
        return InvalidRequestError(f"request body is not valid JSON ({first.get('msg', '')})")
    param = _param_from_loc(first.get("loc", ()))
    msg = _clean(str(first.get("msg", "invalid value")))
    message = f"{param}: {msg}" if param else msg
    if len(items) > 1:
        message += f" (and {len(items) - 1} more error(s))"
    return InvalidRequestError(message, param=param)


def _path(parent: str, step: str | int) -> str:
    if isinstance(step, int):
        return f"{parent}[{step}]"
    return f"{parent}.{step}" if parent else step


def find_lone_surrogate(value: Any) -> tuple[str | None, int, str] | None:
    """The first lone surrogate in the decoded JSON ``value``: ``(param, index, code point)``
    of the string holding it (``param`` names the field, ``None`` for the body itself; a key
    is reported at its object), or ``None`` when every string is valid Unicode text.

    Iterative (no recursion limit); only strings that are not ASCII are searched."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, str):
            if not node.isascii():
                found = _SURROGATE.search(node)
                if found is not None:
                    return path or None, found.start(), f"U+{ord(found.group()):04X}"
        elif isinstance(node, dict):
            children: list[tuple[str, Any]] = []
            for key, item in node.items():
                if isinstance(key, str) and not key.isascii():
                    found = _SURROGATE.search(key)
                    if found is not None:
                        return path or None, found.start(), f"U+{ord(found.group()):04X}"
                children.append((_path(path, key), item))
            stack.extend(reversed(children))
        elif isinstance(node, list):
            stack.extend((_path(path, i), item) for i, item in reversed(list(enumerate(node))))
    return None


def _refuse_lone_surrogates(body: Any) -> None:
    found = find_lone_surrogate(body)
    if found is None:
        return
    param, index, point = found
    where = f"{param}: " if param else ""
    raise InvalidRequestError(
        f"{where}a lone surrogate ({point}) at character {index}: text must be valid Unicode "
        "(a surrogate escape is only valid as half of a pair)",
        param=param,
    )


def parse_request(model: type[M], body: bytes | str | Any, *, max_n: int = DEFAULT_MAX_N) -> M:
    """Validate ``body`` (raw JSON bytes/str, or already-decoded JSON) as ``model``."""
    if isinstance(body, bytes | str):
        try:
            body = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidRequestError(f"request body is not valid JSON ({exc})") from exc
        except RecursionError:
            raise InvalidRequestError("request body is nested too deeply") from None
    _refuse_lone_surrogates(body)
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object")
    try:
        return model.model_validate(body, context=context_for(max_n))
    except ValidationError as exc:
        raise invalid_request_from_validation(exc.errors()) from exc


def install_exception_handlers(app: FastAPI) -> None:
    """Make FastAPI answer validation errors and every :class:`MMISError` in the OpenAI shape."""

    async def on_validation(_: Request, exc: Exception) -> Response:
        errors = exc.errors() if isinstance(exc, RequestValidationError) else []
        return json_response(invalid_request_from_validation(errors))

    async def on_mmis(_: Request, exc: Exception) -> Response:
        return json_response(exc)

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(MMISError, on_mmis)
