"""One request of ``mmis bench serve`` against an OpenAI-compatible endpoint (httpx, async).

:func:`send` POSTs one JSON body and measures it; it never raises for a failed request: an
HTTP status other than 200, a transport error, a timeout or a stream without any generated
text all come back as a :class:`RequestOutput` with ``success`` false, its ``status`` (the
HTTP status, or ``None`` when no response came) and a one-line ``error``.

Streamed (``"stream": true`` in the body), as ``vllm bench serve`` measures it:
- ``ttft``: from just before sending to the first chunk that carries generated text
  (``delta.content``, ``delta.reasoning_content`` or ``delta.tool_calls``; ``text`` on
  ``/v1/completions``); a role-only first chunk is not a token.
- ``itl``: the gaps between successive chunks that carry generated text (one entry per chunk
  after the first; a server that sends several tokens in one chunk shows one longer gap).
- ``output_tokens``: the stream's ``usage.completion_tokens`` when the server sends it
  (``stream_options.include_usage``; ``tokens_from_usage`` is then true), else the number of
  chunks that carried generated text.
- ``latency``: from just before sending to the end of the stream.
- ``headers``: the response's headers (lower-case names), e.g. a gateway's destination.
Not streamed: ``ttft`` is the whole latency, ``itl`` empty, tokens from ``usage``.

The SSE body is split on ``b"\\n"`` only: JSON escapes a newline, while a decoded-line reader
would also split on U+2028 / U+0085, which a random model's text may hold raw inside a string.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

import httpx


@dataclasses.dataclass
class RequestOutput:
    """What one request measured (seconds); see the module docstring for each field."""

    success: bool = False
    status: int | None = None
    error: str = ""
    ttft: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    tokens_from_usage: bool = False
    prompt_tokens: int | None = None
    generated_text: str = ""
    start: float = 0.0  # perf_counter() when it was sent
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    exception: str = ""  # the transport error's class name when no answer came


class _RequestFailed(Exception):
    """A request that got an answer, but not a successful one (the message says why)."""


def _chunk_text(choice: dict[str, Any]) -> str | None:
    """The generated text a streamed choice carries, or None when it carries none."""
    if "text" in choice:  # /v1/completions
        return choice["text"] or None
    delta = choice.get("delta") or {}
    text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
    if text:
        return str(text)
    if delta.get("tool_calls"):
        return ""
    return None


def _message_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return str(choice["text"] or "")
    message = choice.get("message") or {}
    return str(message.get("content") or "")


def _usage(out: RequestOutput, usage: dict[str, Any] | None) -> None:
    if usage and usage.get("completion_tokens") is not None:
        out.output_tokens = int(usage["completion_tokens"])
        out.tokens_from_usage = True
        if usage.get("prompt_tokens") is not None:
            out.prompt_tokens = int(usage["prompt_tokens"])


async def _read_stream(response: httpx.Response, out: RequestOutput) -> None:
    chunks, last = 0, out.start
    parts: list[str] = []
    buffer = b""
    async for data in response.aiter_bytes():
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue
            now = time.perf_counter()
            event = json.loads(payload)
            if event.get("error"):
                raise _RequestFailed(str(event["error"].get("message", event["error"]))[:300])
            _usage(out, event.get("usage"))
            for choice in event.get("choices") or []:
                text = _chunk_text(choice)
                if text is None:
                    continue
                if chunks == 0:
                    out.ttft = now - out.start
                else:
                    out.itl.append(now - last)
                last = now
                chunks += 1
                parts.append(text)
    out.generated_text = "".join(parts)
    if chunks == 0:
        raise _RequestFailed("the stream carried no generated text")
    if not out.tokens_from_usage:
        out.output_tokens = chunks


async def send(
    http: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    headers: dict[str, str] | None = None,
    timeout: float | None = None,
) -> RequestOutput:
    """POST ``body`` to ``url`` once and measure it (never raises for a failed request).

    ``timeout`` bounds the whole request, stream included (None: no bound); a request past it
    fails with ``status`` None and an error starting ``timeout``. ``latency`` is set whether
    the request succeeded or not (the time until it ended, however it ended).
    """
    out = RequestOutput()
    out.start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            await _exchange(http, url, body, headers, out)
        out.success = True
    except TimeoutError:
        out.status, out.exception = None, "TimeoutError"
        out.error = f"timeout: no complete answer within {timeout} s"
    except _RequestFailed as exc:
        out.error = str(exc)
    except httpx.HTTPError as exc:
        out.exception = type(exc).__name__
        prefix = "timeout: " if isinstance(exc, httpx.TimeoutException) else ""
        out.error = f"{prefix}{type(exc).__name__}: {exc}"[:300]
    except ValueError as exc:  # a body that is not the JSON it should be
        out.error = f"bad response: {exc}"[:300]
    out.latency = time.perf_counter() - out.start
    return out


async def _exchange(
    http: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None,
    out: RequestOutput,
) -> None:
    async with http.stream("POST", url, json=body, headers=headers) as response:
        out.status = response.status_code
        out.headers = dict(response.headers)
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            try:
                detail = json.loads(text)
                text = str((detail.get("error") or {}).get("message") or detail)
            except (ValueError, AttributeError):
                pass
            raise _RequestFailed(f"HTTP {response.status_code}: {' '.join(text.split())[:300]}")
        if body.get("stream"):
            await _read_stream(response, out)
            return
        data = json.loads(await response.aread())
        out.ttft = time.perf_counter() - out.start
        choices = data.get("choices") or []
        out.generated_text = _message_text(choices[0]) if choices else ""
        _usage(out, data.get("usage"))
