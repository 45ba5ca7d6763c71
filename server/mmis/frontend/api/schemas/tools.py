"""Tool calling in ``/v1/chat/completions``: tool definitions, ``tool_choice``, tool calls.

Accepted (as OpenAI and vLLM): ``tools`` is a list of ``{"type": "function", "function":
{"name", "description"?, "parameters"?, "strict"?}}`` (at most :data:`MAX_TOOLS`; a name
matches ``^[A-Za-z0-9_-]{1,64}$`` and appears once; ``parameters`` is a JSON Schema object);
``tool_choice`` is ``"none"``, ``"auto"``, ``"required"`` or ``{"type": "function",
"function": {"name": N}}`` where ``N`` names one of ``tools`` (else a 400 naming
``tool_choice``); any value but ``"none"`` needs ``tools``. Without ``tool_choice`` it is
``"auto"`` when tools are given, ``"none"`` otherwise. ``parallel_tool_calls: false`` keeps at
most one call. ``required`` and a named function are enforced as structured outputs
(:mod:`mmis.frontend.api.structured_outputs`): the output must be :func:`required_schema`'s
array or the named function's parameters (:func:`named_schema`); they cannot be combined
with ``response_format`` / ``structured_outputs`` (a 400 naming ``tool_choice``).

Assistant messages may carry ``tool_calls`` (``arguments`` a JSON string, as returned) and
``tool`` messages name the call they answer by ``tool_call_id``; both go to the chat template
(:mod:`mmis.frontend.api.serving_chat`). The response shapes (:class:`ToolCall`,
:class:`ToolCallDelta`) are what :mod:`mmis.frontend.api.tool_calls` produces.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from mmis.frontend.api.schemas.common import OpenAIModel

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

    def arguments_schema(self) -> dict[str, Any]:
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
    field: see :class:`~mmis.frontend.api.schemas.chat.ChatCompletionRequest`)."""
    names = [tool.function.name for tool in tools or []]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"the function name {dup!r} is defined twice")
    if choice is None or choice == "none":
        return
    if not tools:
        raise ValueError(f"{_choice_text(choice)} needs tools")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ValueError(f"the function {choice.function.name!r} is not among tools ({names})")


def required_schema(tools: list[ToolDefinition], parallel: bool) -> dict[str, Any]:
    """``tool_choice: "required"``'s output schema (as vLLM's): a non-empty JSON array of
    ``{"name": N, "parameters": {...}}``, each one of ``tools`` with its own parameters
    schema; the tools' ``$defs`` are hoisted to the root (their ``$ref`` point there).
    ``parallel``: false allows one call only."""
    defs: dict[str, Any] = {}
    branches = []
    for tool in tools:
        params = dict(tool.function.arguments_schema())
        for name, definition in (params.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != definition:
                raise ValueError(f"tools define $defs/{name} differently; rename one")
            defs[name] = definition
        branches.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def named_schema(tools: list[ToolDefinition], name: str) -> dict[str, Any]:
    """A named ``tool_choice``'s output schema: that function's parameters."""
    return next(t.function.arguments_schema() for t in tools if t.function.name == name)


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


def _absent(value: Any) -> bool:
    return value is None


class FunctionCallDelta(BaseModel):
    name: str | None = Field(default=None, exclude_if=_absent)
    arguments: str | None = Field(default=None, exclude_if=_absent)


class ToolCallDelta(BaseModel):
    """``choices[].delta.tool_calls[]``: the first delta of a call has ``id``, ``type`` and
    ``function.name`` (``arguments`` ``""``); later ones only argument fragments (absent
    keys are left out, as OpenAI streams them)."""

    index: int
    id: str | None = Field(default=None, exclude_if=_absent)
    type: Literal["function"] | None = Field(default=None, exclude_if=_absent)
    function: FunctionCallDelta
