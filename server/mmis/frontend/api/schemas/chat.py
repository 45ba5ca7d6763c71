"""``POST /v1/chat/completions`` request model.

Accepted: ``messages`` (at least one; roles system, developer, user, assistant, tool; content
a string or a list of text / image parts, see :mod:`.common`; images only in user messages;
content may be omitted only for assistant messages), and the sampling fields of
:mod:`.sampling`. ``max_completion_tokens`` wins over the older ``max_tokens`` when both are
given. ``logprobs: true`` (with ``top_logprobs`` alternatives, 0-20) returns each generated
token's log-probability. ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (rules in
:mod:`.tools`): an assistant message may carry ``tool_calls`` (then its content may be
omitted), a ``tool`` message must name the call it answers (``tool_call_id``). The legacy
``functions`` / ``function_call``, non-text response formats and audio are rejected.

The JSON schema states the role rules too (:func:`_message_schema`): one branch per role
group, content required but for assistant messages, image parts only in user messages,
``tool_calls`` only on assistant messages, ``tool_call_id`` required on tool messages.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from mmis.frontend.api import structured_outputs
from mmis.frontend.api.schemas.common import (
    Content,
    ImageEmbedsPart,
    ImagePart,
    OpenAIModel,
    TextPart,
    VideoPart,
    add_sampling_rules,
    add_unsupported_to_schema,
    reject_unsupported,
)
from mmis.frontend.api.schemas.sampling import MAX_STOP, MAX_TOP_LOGPROBS, SamplingRequest
from mmis.frontend.api.schemas.tools import (
    MAX_TOOLS,
    AssistantToolCall,
    NamedToolChoice,
    ToolDefinition,
    check_tools,
    named_schema,
    required_schema,
)
from mmis.protocol.messages import StructuredOutputs

# a name declared as a field is supported (its entry inert): tools and tool_choice are now
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (),
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

    def branch(
        roles: list[str], content: dict[str, Any], required: bool, **extra: Any
    ) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {
                "role": {"type": "string", "enum": roles},
                "content": content,
                "name": props["name"],
                **extra,
            },
            "required": ["role", "content"] if required else ["role"],
        }

    call_id = next(b for b in props["tool_call_id"]["anyOf"] if b.get("type") != "null")
    tool = branch(["tool"], text, required=True, tool_call_id=call_id)
    tool["required"].append("tool_call_id")
    schema["oneOf"] = [
        branch(["user"], content, required=True),
        branch(
            ["assistant"],
            {"anyOf": [text, {"type": "null"}]},
            required=False,
            tool_calls=props["tool_calls"],
        ),
        branch(["system", "developer"], text, required=True),
        tool,
    ]


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(json_schema_extra=_message_schema)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # assistant messages only
    tool_call_id: str | None = None  # tool messages: the call answered

    @model_validator(mode="after")
    def _content_rules(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for a {self.role} message")
        if self.role != "user" and any(
            isinstance(p, ImagePart | ImageEmbedsPart) for p in self.parts()
        ):
            raise ValueError(f"image parts are only allowed in user messages, not {self.role}")
        if self.role != "user" and any(isinstance(p, VideoPart) for p in self.parts()):
            raise ValueError(f"video parts are only allowed in user messages, not {self.role}")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls are only allowed in assistant messages, not {self.role}")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id (the call it answers)")
        return self

    def parts(self) -> list[TextPart | ImagePart | VideoPart | ImageEmbedsPart]:
        """The content as parts (a string content is one text part)."""
        if self.content is None:
            return []
        if isinstance(self.content, str):
            return [TextPart(type="text", text=self.content)]
        return list(self.content)


def _request_schema(schema: dict[str, Any], model: type[Any]) -> None:
    add_unsupported_to_schema(schema, model, _UNSUPPORTED)
    add_sampling_rules(schema, MAX_STOP)


def _tool_constraint(
    tools: list[ToolDefinition], choice: str | NamedToolChoice, *, parallel: bool
) -> StructuredOutputs:
    if isinstance(choice, NamedToolChoice):
        index = next(i for i, t in enumerate(tools) if t.function.name == choice.function.name)
        schema = named_schema(tools, choice.function.name)
        return structured_outputs.json_schema(schema, param=f"tools[{index}].function.parameters")
    try:
        schema = required_schema(tools, parallel)
    except ValueError as exc:
        raise structured_outputs.StructuredOutputsError(str(exc), param="tools") from exc
    return structured_outputs.json_schema(schema, param="tools")


def _choice_tag(value: Any) -> str | None:
    if isinstance(value, str):
        return "[mode]"
    if isinstance(value, dict | NamedToolChoice):
        return "choice[function]"
    return None


ToolChoiceField = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("[mode]")]
    | Annotated[NamedToolChoice, Tag("choice[function]")],
    Discriminator(
        _choice_tag,
        custom_error_type="invalid_tool_choice",
        custom_error_message="must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
    ),
]


class ChatCompletionRequest(SamplingRequest):
    model_config = ConfigDict(json_schema_extra=_request_schema)

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoiceField | None = None
    parallel_tool_calls: bool = True

    @field_validator("tools")
    @classmethod
    def _unique_tools(cls, value: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        check_tools(value, None)
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(
        cls, value: str | NamedToolChoice | None, info: ValidationInfo
    ) -> str | NamedToolChoice | None:
        tools = info.data.get("tools")
        check_tools(tools, value)  # type: ignore[arg-type]
        if value == "required" or isinstance(value, NamedToolChoice):
            other = info.data.get("response_format"), info.data.get("structured_outputs")
            if other[1] is not None or (other[0] is not None and other[0].type != "text"):
                raise ValueError(
                    "a required or named tool choice is itself a structured output; it "
                    "cannot be combined with response_format or structured_outputs"
                )
            try:
                _tool_constraint(tools or [], value, parallel=True)
            except structured_outputs.StructuredOutputsError as exc:
                raise ValueError(str(exc)) from exc
        return value

    def structured_constraint(self) -> StructuredOutputs | None:
        """``required`` / a named function constrain the output (:mod:`.tools`); else
        ``response_format`` / ``structured_outputs`` do."""
        choice = self.effective_tool_choice()
        if self.tools and (choice == "required" or isinstance(choice, NamedToolChoice)):
            return _tool_constraint(self.tools, choice, parallel=self.parallel_tool_calls)
        return super().structured_constraint()

    def effective_tool_choice(self) -> str | NamedToolChoice:
        """``tool_choice`` as it applies: ``auto`` with tools, ``none`` without (OpenAI)."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

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
