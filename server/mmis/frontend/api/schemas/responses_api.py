"""``POST /v1/responses`` (the OpenAI Responses API): request and response models.

Accepted: ``input`` as a string or a list of messages (``role`` user, system, developer or
assistant; ``content`` a string or parts ``input_text``, ``input_image`` with an
``image_url`` (data URL, http(s) or file, as chat's), ``input_video`` with a ``video_url``
(the same URLs, as chat's ``video_url`` parts; user turns only, as images) and, in assistant
turns, ``output_text``), ``instructions`` (a system message first), ``max_output_tokens`` and the
sampling fields of :mod:`.sampling`; ``store`` and ``metadata`` are accepted and ignored
(nothing is stored: there is no ``GET /v1/responses/{id}``). Tools, ``previous_response_id``,
reasoning and non-text ``text.format`` are refused with a 400 naming them.

A response is one ``message`` output item with one ``output_text`` part; ``status`` is
``completed``, or ``incomplete`` with ``incomplete_details.reason = "max_output_tokens"``
when the length limit ended it. A stream is the documented event sequence
(``response.created`` ... ``response.completed``), each event an SSE ``event:`` +
``data:`` pair with its ``sequence_number``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mmis.frontend.api.schemas.common import OpenAIModel, reject_unsupported
from mmis.frontend.api.schemas.sampling import SamplingRequest

_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (),
    "tool_choice": ("none", "auto"),
    "previous_response_id": (),
    "reasoning": (),
    "background": (),
    "include": (),
    "text": ({"format": {"type": "text"}},),
}


class InputText(OpenAIModel):
    type: Literal["input_text", "output_text"]
    text: str


class InputImage(OpenAIModel):
    type: Literal["input_image"]
    image_url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None

    @property
    def url(self) -> str:
        return self.image_url

    @property
    def item_uuid(self) -> None:
        return None


class InputVideo(OpenAIModel):
    type: Literal["input_video"]
    video_url: str = Field(min_length=1)

    @property
    def url(self) -> str:
        return self.video_url

    @property
    def item_uuid(self) -> None:
        return None


class InputMessage(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText | InputImage | InputVideo]

    @model_validator(mode="after")
    def _media_from_users(self) -> InputMessage:
        parts = self.content if isinstance(self.content, list) else []
        if self.role != "user" and any(isinstance(p, InputImage) for p in parts):
            raise ValueError(f"input_image parts are only allowed from the user, not {self.role}")
        if self.role != "user" and any(isinstance(p, InputVideo) for p in parts):
            raise ValueError(f"input_video parts are only allowed from the user, not {self.role}")
        return self


class ResponsesRequest(SamplingRequest):
    input: list[InputMessage] | str = Field(min_length=1)  # list first: its errors are named
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    store: bool | None = None
    metadata: dict[str, str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return reject_unsupported(cls, data, _UNSUPPORTED)

    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens if self.max_output_tokens is not None else self.max_tokens

    def messages(self) -> list[InputMessage]:
        """Every turn in order, the instructions first (as a system message)."""
        if isinstance(self.input, str):
            turns = [InputMessage(role="user", content=self.input)]
        else:
            turns = list(self.input)
        if self.instructions:
            turns.insert(0, InputMessage(role="system", content=self.instructions))
        return turns


# ------------------------------------------------------------------------------ responses
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseObject(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    model: str
    output: list[OutputMessage] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool = False
    tool_choice: Literal["none", "auto"] = "auto"
    tools: list[Any] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})


class StreamEvent(BaseModel):
    """One event of a streamed response (the fields besides ``type`` depend on it)."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int

    def sse(self) -> bytes:
        data = self.model_dump_json().encode()
        return b"event: " + self.type.encode() + b"\ndata: " + data + b"\n\n"
