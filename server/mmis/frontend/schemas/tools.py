"""Tool calling in ``/v1/chat/completions``: tool definitions, ``tool_choice``, tool calls.

Accepted (as OpenAI and vLLM): ``tools`` is a list of ``{"type": "function", "function":
{"name", "description"?, "parameters"?, "strict"?}}`` (at most :data:`MAX_TOOLS`; a name
matches ``^[A-Za-z0-9_-]{1,64}$`` and appears once; ``parameters`` is a JSON Schema object);
``tool_choice`` is ``"none"``, ``"auto"``, ``"required"`` or ``{"type": "function",
"function": {"name": N}}`` where ``N`` names one of ``tools`` (else a 400 naming
``tool_choice``); any value but ``"none"`` needs ``tools``. Without ``tool_choice`` it is
``"auto"`` when tools are given, ``"none"`` otherwise. ``parallel_tool_calls: false`` keeps at
most one call.

Assistant messages may carry ``tool_calls`` (``arguments`` a JSON string, as returned) and
``tool`` messages name the call they answer by ``tool_call_id``; both go to the chat template
(:mod:`mmis.frontend.serving_chat`). The response shapes (:class:`ToolCall`,
:class:`ToolCallDelta`) are what :mod:`mmis.frontend.tool_calls` produces.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from mmis.frontend.schemas.common import OpenAIModel

MAX_TOOLS = 128  # OpenAI's limit
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionDefinition(OpenAIModel):
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="a JSON Schema object describing the arguments"
    )
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema_object(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return value
        kind = value.get("type")
        if (
            kind is not None
            and kind != "object"
            and not (isinstance(kind, list) and "object" in kind)
        ):
            raise ValueError("must be a JSON Schema of an object (type 'object')")
        props = value.get("properties")
        if props is not None and not isinstance(props, dict):
            raise ValueError("properties must be an object")
        required = value.get("required")
        if required is not None and not (
            isinstance(required, list) and all(isinstance(r, str) for r in required)
        ):
            raise ValueError("required must be a list of property names")
        return value

    def schema(self) -> dict[str, Any]:
        """The arguments' JSON Schema (a missing one is any object, as vLLM does)."""
        if not self.parameters:
            return {"type": "object", "properties": {}}
        return self.parameters


class ToolDefinition(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(OpenAIModel):
    name: str
    arguments: str = Field(description="the arguments as a JSON string")


class AssistantToolCall(OpenAIModel):
    """A tool call of an earlier assistant turn (request side)."""

    id: str
    type: Literal["function"]
    function: ToolCallFunction


def check_tools(tools: list[ToolDefinition] | None, choice: ToolChoice | None) -> None:
    """The cross-field rules; raises ``ValueError`` with the reason (the caller names the
    field: see :class:`~mmis.frontend.schemas.chat.ChatCompletionRequest`)."""
    names = [tool.function.name for tool in tools or []]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"tools: the function name {dup!r} is defined twice")
    if choice is None or choice == "none":
        return
    if not tools:
        raise ValueError(f"tool_choice: {_choice_text(choice)} needs tools")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ValueError(
            f"tool_choice: the function {choice.function.name!r} is not among tools ({names})"
        )


def _choice_text(choice: ToolChoice) -> str:
    return f"function {choice.function.name!r}" if isinstance(choice, NamedToolChoice) else choice


# ---------------------------------------------------------------------------- responses


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON string, as OpenAI returns it


class ToolCall(BaseModel):
    """``choices[].message.tool_calls[]``."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """``choices[].delta.tool_calls[]``: the first delta of a call has ``id``, ``type`` and
    ``function.name`` (``arguments`` ``""``); later ones only argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta
