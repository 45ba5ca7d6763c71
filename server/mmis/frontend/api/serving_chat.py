"""``POST /v1/chat/completions``: messages -> chat template -> generation (whole or streamed).

Invariants:
- The messages are templated as Responses' input is (:mod:`mmis.frontend.api.templating`):
  images as ``{"type": "image"}`` parts and videos (``video_url`` parts) as
  ``{"type": "video"}`` parts, in prompt order, so the template writes exactly one image
  (video) token per item; the renderer expands them. ``developer`` messages are rendered as
  ``system`` (templates rarely know the newer role); an assistant message without content
  is rendered with empty text.
- Tools reach the template as OpenAI tool definitions, unless ``tool_choice`` is ``none``
  (then they are neither offered nor parsed); an earlier assistant turn's ``tool_calls`` go
  with their ``arguments`` as an object (what Hugging Face templates expect; a string that is
  not JSON stays a string), a tool message with its ``tool_call_id``. Each choice's output
  is parsed by its own :mod:`~mmis.frontend.api.tool_calls` parser (``n`` choices, ``n``
  parsers), so one format object serves exactly one request.
- A template that fails on the client's messages is a 400 naming ``messages``, not a 500.
- The template runs on a worker thread (a huge conversation never stalls the event loop).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from mmis.frontend.api import logprobs, tool_calls
from mmis.frontend.api.logprobs import TokenLogprob
from mmis.frontend.api.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    Usage,
    sse_chunk,
)
from mmis.frontend.api.schemas.tools import NamedToolChoice
from mmis.frontend.api.serving_common import new_request_id
from mmis.frontend.api.serving_generate import Choice, ChunkStream, TextGenerator
from mmis.frontend.api.templating import render_source, template_messages
from mmis.frontend.client.renderer import UNBOUND, SourcePrompt
from mmis.frontend.client.tenancy import ANONYMOUS
from mmis.frontend.errors import EngineUnavailableError

if TYPE_CHECKING:
    from mmis.frontend.state import FrontendState


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _tool_fields(message: Any) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if message.tool_calls:
        extra["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(call.function.arguments),
                },
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        extra["tool_call_id"] = message.tool_call_id
    return extra


def template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tool definitions the template offers (none under ``tool_choice: none``)."""
    if not req.tools or req.effective_tool_choice() == "none":
        return None
    return [tool.model_dump(exclude_none=True) for tool in req.tools]


class ChatFormat(ChunkStream):
    """Chat's shapes for ONE request (its choices' tool-call parsers live here)."""

    def __init__(self, model: str, req: ChatCompletionRequest | None = None) -> None:
        self.model = model
        self.choice: str | None = None
        self.function: str | None = None
        self.parallel = True
        if req is not None and req.tools:
            choice = req.effective_tool_choice()
            if isinstance(choice, NamedToolChoice):
                self.choice, self.function = "named", choice.function.name
            else:
                self.choice = choice
            self.parallel = req.parallel_tool_calls
        self.parsers: dict[int, tool_calls.ToolCallParser] = {}

    def _parser(self, index: int) -> tool_calls.ToolCallParser | None:
        if self.choice is None:  # no tools offered: nothing to parse
            return None
        if index not in self.parsers:
            parser = tool_calls.parser_for(self.choice, self.function, self.parallel)
            if parser is None:
                return None
            self.parsers[index] = parser
        return self.parsers[index]

    def _message(self, index: int, text: str, finish: str | None) -> tuple[Any, str | None]:
        parser = self._parser(index)
        if parser is None:
            return AssistantMessage(content=text), finish
        parser.feed(text, final=True)
        parsed = parser.result()
        message = AssistantMessage(content=parsed.content, tool_calls=parsed.tool_calls or None)
        return message, parser.finish(finish)

    def whole(
        self, request_id: str, choices: Sequence[Choice], usage: Usage
    ) -> ChatCompletionResponse:
        answers = []
        for i, (text, finish, rows) in enumerate(choices):
            message, reason = self._message(i, text, finish)
            answers.append(
                ChatChoice(
                    index=i,
                    message=message,
                    finish_reason=reason,  # type: ignore[arg-type]
                    logprobs=None if rows is None else logprobs.chat(rows),
                )
            )
        return ChatCompletionResponse(id=request_id, model=self.model, choices=answers, usage=usage)

    def stream_delta(
        self,
        request_id: str,
        index: int,
        text: str | None,
        finish: str | None,
        first: bool,
        logprobs: list[TokenLogprob] | None,
    ) -> list[bytes]:
        parser = self._parser(index)
        if parser is None:
            return super().stream_delta(request_id, index, text, finish, first, logprobs)
        out = parser.feed(text or "", final=finish is not None)
        if finish is not None:
            finish = parser.finish(finish)
        if not (first or out.content or out.tool_calls or finish or logprobs):
            return []
        chunk = self.chunk(request_id, index, out.content, finish, first, logprobs)
        chunk.choices[0].delta.tool_calls = out.tool_calls or None
        return [sse_chunk(chunk)]

    def chunk(
        self,
        request_id: str,
        index: int,
        text: str | None,
        finish: str | None,
        first: bool,
        rows: list[TokenLogprob] | None = None,
    ) -> ChatCompletionChunk:
        delta = ChatDelta(
            role="assistant" if first else None, content=text or ("" if first else None)
        )
        choice = ChatChunkChoice(
            index=index,
            delta=delta,
            finish_reason=finish,  # type: ignore[arg-type]
            logprobs=None if rows is None else logprobs.chat(rows),
        )
        return ChatCompletionChunk(id=request_id, model=self.model, choices=[choice])

    def usage_chunk(self, request_id: str, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=request_id, model=self.model, choices=[], usage=usage)


class ChatServing:
    def __init__(self, state: FrontendState) -> None:
        self.state = state
        self.generator = TextGenerator(state, "chat")

    async def create(
        self, http: Request, req: ChatCompletionRequest, *, tenant: str | None = ANONYMOUS
    ) -> Response:
        source = await self._source(req, tenant)
        fmt = ChatFormat(self.generator.model_name(req), req)
        return await self.generator.respond(http, req, source, fmt, new_request_id("chatcmpl"))

    async def block_keys(
        self, req: ChatCompletionRequest, *, tenant: str | None = ANONYMOUS
    ) -> dict[str, Any]:
        """What P1's prefix cache would call this request's full prompt blocks
        (``protocol/block_keys.py``), for a router matching them against the blocks each
        replica announced (docs/ROUTING.md). Nothing is sent to P1; no cache changes and no
        uuid is bound. A uuid-only item ``tenant`` has no binding for is left out of
        ``mm_hashes``, and the keys (and ``prompt_tokens``) stop where the first item P0
        cannot size starts (``Renderer.keys_sync``)."""
        block_size = self.state.client.engine_info.get("block_size")
        if block_size is None:
            raise EngineUnavailableError("the engine has not reported its block size yet")
        source = await self._source(req, tenant, keys_only=True)
        adapter = await self.generator.adapter(req)  # its blocks chain from its id (client/lora.py)
        lora_id = 0 if adapter is None else adapter.lora_id
        num_tokens, keys = await self.state.renderer.keys(source, int(block_size), lora_id)
        return {
            "block_size": int(block_size),
            "prompt_tokens": num_tokens,
            "block_keys": [key.hex() for key in keys],
            "mm_hashes": [item.mm_hash for item in source.items if item.mm_hash != UNBOUND],
        }

    async def _source(
        self, req: ChatCompletionRequest, tenant: str | None, *, keys_only: bool = False
    ) -> SourcePrompt:
        messages, images = template_messages(req.messages, "messages", _tool_fields)
        tools = template_tools(req)
        return await render_source(
            self.state, messages, images, "messages", tools, tenant=tenant, keys_only=keys_only
        )
