"""``POST /v1/chat/completions``: messages -> chat template -> generation (whole or streamed).

Invariants:
- Images reach the chat template as ``{"type": "image"}`` parts, in prompt order, so the
  template writes exactly one image token per image; the renderer expands them.
- ``developer`` messages are rendered as ``system`` (templates rarely know the newer role);
  an assistant message without content is rendered with empty text.
- A template that fails on the client's messages is a 400 naming ``messages``, not a 500.
- The template runs on a worker thread (a huge conversation never stalls the event loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from mmis.frontend import logprobs
from mmis.frontend.errors import InvalidRequestError
from mmis.frontend.logprobs import TokenLogprob
from mmis.frontend.renderer import ImageRef
from mmis.frontend.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ImagePart,
    Usage,
)
from mmis.frontend.serving_common import new_request_id
from mmis.frontend.serving_generate import Choice, ChunkStream, TextGenerator

if TYPE_CHECKING:
    from mmis.frontend.state import FrontendState


def template_messages(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """Messages in the processor's chat-template shape, and the images in prompt order."""
    messages: list[dict[str, Any]] = []
    images: list[ImageRef] = []
    for i, message in enumerate(req.messages):
        role = "system" if message.role == "developer" else message.role
        if isinstance(message.content, str) or message.content is None:
            messages.append({"role": role, "content": message.content or ""})
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(message.content):
            if isinstance(part, ImagePart):
                parts.append({"type": "image"})
                images.append(ImageRef(part.url, part.item_uuid, f"messages[{i}].content[{j}]"))
            else:
                parts.append({"type": "text", "text": part.text})
        messages.append({"role": role, "content": parts})
    return messages, images


class ChatFormat(ChunkStream):
    def __init__(self, model: str) -> None:
        self.model = model

    def whole(
        self, request_id: str, choices: Sequence[Choice], usage: Usage
    ) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=request_id,
            model=self.model,
            choices=[
                ChatChoice(
                    index=i,
                    message=AssistantMessage(content=text),
                    finish_reason=finish,  # type: ignore[arg-type]
                    logprobs=None if rows is None else logprobs.chat(rows),
                )
                for i, (text, finish, rows) in enumerate(choices)
            ],
            usage=usage,
        )

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
        self.format = ChatFormat(state.model_name)

    async def create(self, http: Request, req: ChatCompletionRequest) -> Response:
        messages, images = template_messages(req)
        try:
            # the template renders the whole conversation: on a worker, not the event loop
            text = await asyncio.to_thread(self.state.processor.chat_prompt, messages)
        except Exception as exc:  # jinja errors, template-raised exceptions
            raise InvalidRequestError(
                f"the model's chat template rejected the messages: {exc}", param="messages"
            ) from exc
        source = await self.state.renderer.prepare(text, images)
        return await self.generator.respond(
            http, req, source, self.format, new_request_id("chatcmpl")
        )
