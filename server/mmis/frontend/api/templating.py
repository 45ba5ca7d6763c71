"""OpenAI messages -> the processor's chat-template conversation -> a prepared prompt.

One templating for every endpoint that takes turns: chat (``messages``,
:mod:`mmis.frontend.api.serving_chat`) and Responses (``input``,
:mod:`mmis.frontend.api.serving_responses`).

Invariants:
- Images (``image_embeds`` parts too: an item whose content is the client's embeddings,
  accepted only with ``--enable-mm-embeds``) reach the chat template as ``{"type": "image"}``
  parts and videos (chat's
  ``video_url``, Responses' ``input_video``) as ``{"type": "video"}`` parts, in prompt order,
  so the template writes exactly one image (video) token per item; the renderer expands them.
  Each item's ``param`` is its JSON path (``messages[i].content[j]``, ``input[i].content[j]``).
- ``developer`` messages are rendered as ``system`` (templates rarely know the newer role);
  a message without content (a chat assistant turn) is rendered with empty text.
- A template that fails on the client's turns is a 400 naming them (``messages``, ``input``),
  not a 500; the template runs on a worker thread (a huge conversation never stalls the
  event loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mmis.frontend.api.schemas import ChatMessage, ImageEmbedsPart, ImagePart, VideoPart
from mmis.frontend.api.schemas.responses_api import InputImage, InputMessage, InputVideo
from mmis.frontend.client.renderer import VIDEO, ImageRef, SourcePrompt
from mmis.frontend.client.tenancy import ANONYMOUS
from mmis.frontend.errors import InvalidRequestError

if TYPE_CHECKING:
    from mmis.frontend.state import FrontendState


def _no_fields(message: Any) -> dict[str, Any]:
    return {}


def template_messages(
    messages: Sequence[ChatMessage | InputMessage],
    param: str,
    fields: Callable[[Any], dict[str, Any]] = _no_fields,
) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """``messages`` in the processor's chat-template shape, and the images and videos in
    prompt order. ``param`` names the turns in the request (``messages``, ``input``);
    ``fields(message)`` adds an endpoint's own keys to a turn (chat's tool calls)."""
    turns: list[dict[str, Any]] = []
    images: list[ImageRef] = []
    for i, message in enumerate(messages):
        role = "system" if message.role == "developer" else message.role
        extra = fields(message)
        if isinstance(message.content, str) or message.content is None:
            turns.append({"role": role, "content": message.content or "", **extra})
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(message.content):
            where = f"{param}[{i}].content[{j}]"
            if isinstance(part, ImagePart | InputImage):
                parts.append({"type": "image"})
                images.append(ImageRef(part.url, part.item_uuid, where, part.detail))
            elif isinstance(part, ImageEmbedsPart):  # checked by the renderer (the flag first)
                parts.append({"type": "image"})
                grid = tuple(part.image_grid_thw) if part.image_grid_thw is not None else None
                images.append(ImageRef(None, None, where, embeds=part.image_embeds, grid_thw=grid))
            elif isinstance(part, VideoPart | InputVideo):
                parts.append({"type": "video"})
                images.append(ImageRef(part.url, part.item_uuid, where, modality=VIDEO))
            else:
                parts.append({"type": "text", "text": part.text})
        turns.append({"role": role, "content": parts, **extra})
    return turns, images


async def render_source(
    state: FrontendState,
    messages: Sequence[Mapping[str, Any]],
    images: Sequence[ImageRef],
    param: str,
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    tenant: str | None = ANONYMOUS,
    keys_only: bool = False,
) -> SourcePrompt:
    """The chat template applied to ``messages`` (and ``tools``), then the prompt prepared
    with its ``images`` (:meth:`~mmis.frontend.client.renderer.Renderer.prepare`: their uuids
    are ``tenant``'s; ``keys_only`` for a router's key request)."""
    try:
        # the template renders the whole conversation: on a worker, not the event loop
        text = await asyncio.to_thread(state.processor.chat_prompt, messages, tools)
    except Exception as exc:  # jinja errors, template-raised exceptions
        raise InvalidRequestError(
            f"the model's chat template rejected the {param}: {exc}", param=param
        ) from exc
    return await state.renderer.prepare(
        text, images, param=param, tenant=tenant, keys_only=keys_only
    )
