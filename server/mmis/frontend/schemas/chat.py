"""``POST /v1/chat/completions`` request model.

Accepted: ``messages`` (at least one; roles system, developer, user, assistant, tool; content
a string or a list of text / image parts, see :mod:`.common`; images only in user messages;
content may be omitted only for assistant messages), and the sampling fields of
:mod:`.sampling`. ``max_completion_tokens`` wins over the older ``max_tokens`` when both are
given. ``logprobs: true`` (with ``top_logprobs`` alternatives, 0-20) returns each generated
token's log-probability. Tool calling, non-text response formats and audio are rejected.

The JSON schema states the role rules too (:func:`_message_schema`): one branch per role
group, content required but for assistant messages, image parts only in user messages.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from mmis.frontend.schemas.common import (
    Content,
    ImagePart,
    OpenAIModel,
    TextPart,
    add_sampling_rules,
    add_unsupported_to_schema,
    reject_unsupported,
)
from mmis.frontend.schemas.sampling import MAX_STOP, MAX_TOP_LOGPROBS, SamplingRequest

_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (),
    "functions": (),
    "tool_choice": ("none", "auto"),
    "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
}


def _text_only(content: dict[str, Any]) -> dict[str, Any]:
    """``Content``'s schema (string | list of parts) with text parts only."""
    branches = []
    for branch in content["oneOf"]:
        if branch.get("type") == "array":
            parts = branch["items"]["oneOf"]
            text = next(p for p in parts if "TextPart" in str(p.get("$ref", "")))
            branch = {**branch, "items": text}
        branches.append(branch)
    return {"oneOf": branches}


def _message_schema(schema: dict[str, Any]) -> None:
    """One branch per role group, as :meth:`ChatMessage._content_rules` decides."""
    props = schema.pop("properties")
    schema.pop("required", None)
    schema.pop("type", None)
    content = next(b for b in props["content"]["anyOf"] if b.get("type") != "null")
    text = _text_only(content)

    def branch(roles: list[str], content: dict[str, Any], required: bool) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {
                "role": {"type": "string", "enum": roles},
                "content": content,
                "name": props["name"],
            },
            "required": ["role", "content"] if required else ["role"],
        }

    schema["oneOf"] = [
        branch(["user"], content, required=True),
        branch(["assistant"], {"anyOf": [text, {"type": "null"}]}, required=False),
        branch(["system", "developer", "tool"], text, required=True),
    ]


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(json_schema_extra=_message_schema)

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


def _request_schema(schema: dict[str, Any], model: type[Any]) -> None:
    add_unsupported_to_schema(schema, model, _UNSUPPORTED)
    add_sampling_rules(schema, MAX_STOP)


class ChatCompletionRequest(SamplingRequest):
    model_config = ConfigDict(json_schema_extra=_request_schema)

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs", False):
            raise ValueError("needs logprobs: true")
        return value

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return reject_unsupported(cls, data, _UNSUPPORTED)

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
