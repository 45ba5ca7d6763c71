"""Structured outputs in P0: what a request asks for -> the wire constraint P1 enforces.

A constraint is a :class:`~mmis.protocol.messages.StructuredOutputs` on
``SamplingParams.structured``; P1 compiles it with its grammar engine and masks every token it
does not allow before sampling (``engine/execution/structured.py``). The request fields that make
one (``frontend/api/schemas/sampling.py``):

- ``response_format`` (OpenAI): ``{"type": "json_object"}`` -> :func:`json_object`;
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` -> :func:`json_schema`
  (``{"type": "text"}`` is no constraint);
- ``structured_outputs`` (vLLM's extra_body field, its current name since vLLM 0.12 replaced
  ``guided_*``): exactly one of ``json`` (a schema), ``json_object: true``, ``regex``,
  ``choice`` (a list of strings) or ``grammar`` (EBNF/GBNF with a ``root`` rule).

Serving code that needs a constraint of its own (tool calls: ``tool_choice: "required"`` or a
named function) calls :func:`json_schema` with the schema it wants and its own ``param`` and
sets the result on ``SamplingParams.structured`` (e.g. ``msgspec.structs.replace``); nothing
has to go through ``response_format``.

Invariants:
- P0 checks only what is cheap and certain here (types, sizes, non-empty values); whether a
  schema, regex or grammar compiles is P1's answer (its grammar engine is the authority):
  a spec it cannot compile comes back as an ``invalid_request`` error whose ``param`` is the
  ``param`` given here, i.e. a 400 naming the field the client used.
- ``spec`` is deterministic for equal inputs (JSON with sorted keys, no spaces), so P1's
  compiled-grammar cache hits for every request that sends the same schema.
- Every error here is :class:`StructuredOutputsError` (a ``ValueError``) whose message is for
  the client and whose ``param`` names the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from mmis.protocol.messages import StructuredOutputs

JSON = "json"
JSON_OBJECT = "json_object"
REGEX = "regex"
CHOICE = "choice"
GRAMMAR = "grammar"
KINDS = (JSON, JSON_OBJECT, REGEX, CHOICE, GRAMMAR)

MAX_SPEC_CHARS = 64 * 1024  # a schema / regex / grammar larger than this is refused
MAX_CHOICES = 256


class StructuredOutputsError(ValueError):
    """A constraint P0 refuses before P1 sees it; ``param`` names the request field."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


def _sized(kind: str, spec: str, param: str) -> StructuredOutputs:
    if len(spec) > MAX_SPEC_CHARS:
        raise StructuredOutputsError(
            f"the {kind} constraint is {len(spec)} characters; at most {MAX_SPEC_CHARS}",
            param=param,
        )
    return StructuredOutputs(kind, spec, param)


def json_schema(schema: Mapping[str, Any] | bool, *, param: str) -> StructuredOutputs:
    """The constraint "the output is one JSON value that validates against ``schema``".

    ``schema``: a JSON Schema (a JSON object, or ``true``); ``param``: the request field it
    came from, named by the 400 if it does not compile (``"response_format"``,
    ``"tool_choice"``, ...). Objects are generated in strict mode: properties the schema
    does not name are not produced, and separators are compact, so a bounded schema gives a
    bounded output. Raises :class:`StructuredOutputsError`.
    """
    if schema is True:
        schema = {}
    if not isinstance(schema, Mapping):
        raise StructuredOutputsError("the JSON schema must be a JSON object", param=param)
    try:
        text = json.dumps(schema, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise StructuredOutputsError(f"the JSON schema is not JSON: {exc}", param=param) from exc
    return _sized(JSON, text, param)


def json_object(*, param: str) -> StructuredOutputs:
    """The constraint "the output is one JSON object" (OpenAI's ``json_object`` mode)."""
    return StructuredOutputs(JSON_OBJECT, "", param)


def regex(pattern: str, *, param: str) -> StructuredOutputs:
    """The constraint "the whole output matches ``pattern``"."""
    if not isinstance(pattern, str) or not pattern:
        raise StructuredOutputsError("the regex must be a non-empty string", param=param)
    return _sized(REGEX, pattern, param)


def choice(options: Sequence[str], *, param: str) -> StructuredOutputs:
    """The constraint "the output is exactly one of ``options``"."""
    if isinstance(options, str) or not isinstance(options, Sequence) or not options:
        raise StructuredOutputsError("choice must be a non-empty list of strings", param=param)
    if len(options) > MAX_CHOICES:
        raise StructuredOutputsError(f"choice allows at most {MAX_CHOICES} options", param=param)
    if not all(isinstance(o, str) and o for o in options):
        raise StructuredOutputsError("every choice must be a non-empty string", param=param)
    return _sized(CHOICE, json.dumps(list(options), separators=(",", ":")), param)


def grammar(text: str, *, param: str) -> StructuredOutputs:
    """The constraint "the output matches the EBNF (GBNF) ``text``" (its ``root`` rule)."""
    if not isinstance(text, str) or not text.strip():
        raise StructuredOutputsError("the grammar must be a non-empty string", param=param)
    return _sized(GRAMMAR, text, param)


def from_response_format(value: Mapping[str, Any]) -> StructuredOutputs | None:
    """OpenAI's ``response_format`` (already shape-checked) -> a constraint or ``None``."""
    param = "response_format"
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object(param=param)
    if kind == "json_schema":
        spec = value.get("json_schema") or {}
        if "schema" not in spec:
            # OpenAI requires a schema; without one any JSON object will do (as vLLM does)
            return json_object(param=param)
        return json_schema(spec["schema"], param=param)
    raise StructuredOutputsError(f"unknown response_format type {kind!r}", param=param)


def from_vllm_fields(value: Mapping[str, Any]) -> StructuredOutputs:
    """vLLM's ``structured_outputs`` object (exactly one constraint key) -> a constraint."""
    param = "structured_outputs"
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    if len(given) != 1:
        names = ", ".join(KINDS)
        raise StructuredOutputsError(
            f"structured_outputs must set exactly one of {names}; got {sorted(given) or 'none'}",
            param=param,
        )
    ((kind, spec),) = given.items()
    if kind == JSON:
        return json_schema(spec, param=param)
    if kind == JSON_OBJECT:
        return json_object(param=param)
    if kind == REGEX:
        return regex(spec, param=param)
    if kind == CHOICE:
        return choice(spec, param=param)
    if kind == GRAMMAR:
        return grammar(spec, param=param)
    raise StructuredOutputsError(f"structured_outputs.{kind} is not supported", param=param)
