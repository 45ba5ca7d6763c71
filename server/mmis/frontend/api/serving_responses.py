"""``POST /v1/responses``: input messages -> chat template -> the same generation as chat.

The request (:mod:`mmis.frontend.api.schemas.responses_api`) becomes chat-template messages
exactly as chat's messages do (:mod:`mmis.frontend.api.templating`: ``input_text`` -> text
parts, ``input_image`` -> image parts, ``input_video`` -> video parts, ``instructions`` -> a
system message), then runs through
:class:`~mmis.frontend.api.serving_generate.TextGenerator` exactly as chat does: the same
renderer, recovery policy and drift chain (one retry with the cache bypassed before any byte;
503 on a second miss; after bytes, the SSE error event the openai SDK raises on). Only the
shapes differ (:class:`ResponsesFormat`).

Invariants:
- One :class:`ResponsesFormat` per request: it carries the request's echoed parameters and,
  for a stream, the text so far (the ``done`` events and ``response.completed`` repeat it).
- Stream events come in the documented order, numbered from 0: ``response.created``,
  ``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``,
  ``response.output_text.delta``..., ``response.output_text.done``,
  ``response.content_part.done``, ``response.output_item.done``, ``response.completed``.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Request
from fastapi.responses import Response

from mmis.frontend.api.logprobs import TokenLogprob
from mmis.frontend.api.schemas import Usage
from mmis.frontend.api.schemas.responses_api import (
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    StreamEvent,
)
from mmis.frontend.api.serving_generate import Choice, TextGenerator
from mmis.frontend.api.templating import render_source, template_messages
from mmis.frontend.client.tenancy import ANONYMOUS

if TYPE_CHECKING:
    from mmis.frontend.state import FrontendState


class ResponsesFormat:
    def __init__(self, model: str, req: ResponsesRequest) -> None:
        self.model = model
        self.req = req
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.text = ""
        self.finish: str | None = None
        self.sequence = 0

    def _response(
        self, request_id: str, text: str | None, finish: str | None, usage: Usage | None
    ) -> ResponseObject:
        done = text is not None
        incomplete = finish == "length"
        status: Literal["in_progress", "completed", "incomplete"] = (
            "in_progress" if not done else ("incomplete" if incomplete else "completed")
        )
        output: list[OutputMessage] = []
        if done:
            item_status: Literal["completed", "incomplete"] = (
                "incomplete" if incomplete else "completed"
            )
            content = [OutputText(text=text or "")]
            output = [OutputMessage(id=self.item_id, status=item_status, content=content)]
        return ResponseObject(
            id=request_id,
            status=status,
            model=self.model,
            output=output,
            usage=None if usage is None else _usage(usage),
            incomplete_details=IncompleteDetails() if done and incomplete else None,
            instructions=self.req.instructions,
            max_output_tokens=self.req.max_output_tokens,
            temperature=self.req.temperature,
            top_p=self.req.top_p,
        )

    def whole(self, request_id: str, choices: Sequence[Choice], usage: Usage) -> ResponseObject:
        (text, finish, _), *_ = choices
        return self._response(request_id, text, finish, usage)

    # -- the stream -----------------------------------------------------------------------
    def _event(self, type_: str, **fields: Any) -> bytes:
        event = StreamEvent(type=type_, sequence_number=self.sequence, **fields)
        self.sequence += 1
        return event.sse()

    def _ids(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def stream_start(self, request_id: str) -> list[bytes]:
        started = self._response(request_id, None, None, None).model_dump(mode="json")
        item = OutputMessage(id=self.item_id, status="in_progress").model_dump(mode="json")
        part = OutputText(text="").model_dump(mode="json")
        return [
            self._event("response.created", response=started),
            self._event("response.in_progress", response=started),
            self._event("response.output_item.added", output_index=0, item=item),
            self._event("response.content_part.added", part=part, **self._ids()),
        ]

    def stream_delta(
        self,
        request_id: str,
        index: int,
        text: str | None,
        finish: str | None,
        first: bool,
        logprobs: list[TokenLogprob] | None,
    ) -> list[bytes]:
        if finish is not None:
            self.finish = finish
        if not text:
            return []
        self.text += text
        return [self._event("response.output_text.delta", delta=text, logprobs=[], **self._ids())]

    def stream_end(self, request_id: str, usage: Usage, include_usage: bool) -> list[bytes]:
        final = self._response(request_id, self.text, self.finish, usage)
        item = final.output[0]
        part = item.content[0].model_dump(mode="json")
        last = "response.incomplete" if final.status == "incomplete" else "response.completed"
        return [
            self._event("response.output_text.done", text=self.text, logprobs=[], **self._ids()),
            self._event("response.content_part.done", part=part, **self._ids()),
            self._event(
                "response.output_item.done", output_index=0, item=item.model_dump(mode="json")
            ),
            self._event(last, response=final.model_dump(mode="json")),
        ]


def _usage(usage: Usage) -> ResponseUsage:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached),
    )


class ResponsesServing:
    def __init__(self, state: FrontendState) -> None:
        self.state = state
        self.generator = TextGenerator(state, "responses")

    async def create(
        self, http: Request, req: ResponsesRequest, *, tenant: str | None = ANONYMOUS
    ) -> Response:
        messages, images = template_messages(req.messages(), "input")
        source = await render_source(self.state, messages, images, "input", tenant=tenant)
        fmt = ResponsesFormat(self.generator.model_name(req), req)
        return await self.generator.respond(http, req, source, fmt, f"resp_{uuid.uuid4().hex}")
