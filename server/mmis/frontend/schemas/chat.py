"""``POST /v1/chat/completions`` request model.

Accepted: ``messages`` (at least one; roles system, developer, user, assistant, tool; content
a string or a list of text / image parts, see :mod:`.common`; images only in user messages;
content may be omitted only for assistant messages), and the sampling fields of
:mod:`.sampling`. ``max_completion_tokens`` wins over the older ``max_tokens`` when both are
given. Tool calling, logprobs, non-text response formats, penalties and audio are rejected.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import Field, model_validator

from mmis.frontend.schemas.common import (
    Content,
    ImagePart,
    OpenAIModel,
    TextPart,
    reject_unsupported,
)
from mmis.frontend.schemas.sampling import SamplingRequest

_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (),
    "functions": (),
    "tool_choice": ("none", "auto"),
    "function_call": ("none", "auto"),
    "logprobs": (),
    "top_logprobs": (),
    "logit_bias": (),
    "frequency_penalty": (),
    "presence_penalty": (),
    "response_format": ({"type": "text"},),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
}


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_rules(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for a {self.role} message")
        if self.role != "user" and any(isinstance(p, ImagePart) for p in self.parts()):
            raise ValueError(f"image parts are only allowed in user messages, not {self.role}")
        return self

    def parts(self) -> list[TextPart | ImagePart]:
        """The content as parts (a string content is one text part)."""
        if self.content is None:
            return []
        if isinstance(self.content, str):
            return [TextPart(type="text", text=self.content)]
        return list(self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return reject_unsupported(cls.__name__, data, _UNSUPPORTED)

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def image_parts(self) -> Iterator[tuple[str, ImagePart]]:
        """Every image part with its ``param`` path, in prompt order."""
        for i, message in enumerate(self.messages):
            if isinstance(message.content, list):
                for j, part in enumerate(message.content):
                    if isinstance(part, ImagePart):
                        yield f"messages[{i}].content[{j}]", part
