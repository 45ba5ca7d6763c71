"""Wire schema descriptions and the append-only rule that keeps old and new peers talking.

A struct's *description* is its msgspec tag, whether it is ``array_like``, and its fields in
order (name, type string, whether the field is required). A recorded description (checked
in with the golden fixtures) and the current one satisfy the append-only rule when:

- the struct still exists, is still ``array_like`` and keeps its tag;
- its current fields START WITH the recorded fields, same names and types, in order
  (so inserting, removing, reordering, renaming or retyping a field is caught);
- a recorded optional field did not become required, and every appended field has a
  default (so a newer decoder still reads an older message).

A field may be *retired* in place: renamed ``_<name>``, same type, with a default. It keeps
its position, so every version still decodes; the current code writes the default and reads
nothing from it (``MultiModalFeature._identifier``, retired in v6).

:data:`WIRE_STRUCTS` lists every struct that crosses the wire; a new one must be added here.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from mmis.protocol.messages import (
    AbortRequests,
    CachedItem,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    MultiModalFeature,
    PlaceholderRange,
    PoolingParams,
    RequestError,
    SamplingParams,
    ShmAddress,
    StructuredOutputs,
    TokenLogprobs,
    UtilityCall,
    UtilityResult,
)
from mmis.protocol.tensors import TensorHeader

WIRE_STRUCTS: tuple[type[msgspec.Struct], ...] = (
    PlaceholderRange,
    ShmAddress,
    TensorHeader,
    MultiModalFeature,
    StructuredOutputs,
    SamplingParams,
    PoolingParams,
    EngineCoreRequest,
    AbortRequests,
    RequestError,
    UtilityCall,
    UtilityResult,
    TokenLogprobs,
    EngineCoreOutput,
    CachedItem,
    EngineCoreOutputs,
)

Description = dict[str, Any]


def type_name(tp: Any) -> str:
    """A stable, readable spelling of a field type (independent of the Python version)."""
    if tp is None or tp is types.NoneType:
        return "None"
    if tp is Any:
        return "Any"
    if tp is Ellipsis:
        return "..."
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(type_name(arg) for arg in args)
    if origin is not None:
        return f"{type_name(origin)}[{', '.join(type_name(arg) for arg in args)}]"
    return getattr(tp, "__name__", repr(tp))


def describe(struct: type[msgspec.Struct]) -> Description:
    config = struct.__struct_config__
    return {
        "tag": config.tag,
        "array_like": config.array_like,
        "fields": [
            {"name": f.name, "type": type_name(f.type), "required": f.required}
            for f in msgspec.structs.fields(struct)
        ],
    }


def describe_all(structs: Iterable[type[msgspec.Struct]] = WIRE_STRUCTS) -> dict[str, Description]:
    return {struct.__name__: describe(struct) for struct in structs}


def _field_text(field: Mapping[str, Any]) -> str:
    return f"{field['name']}: {field['type']}"


def _retired(recorded: Mapping[str, Any], now: Mapping[str, Any]) -> bool:
    """Whether ``now`` is ``recorded`` retired in place (``_<name>``, same type, optional)."""
    return (
        now["name"] == f"_{recorded['name'].lstrip('_')}"
        and now["type"] == recorded["type"]
        and not now["required"]
    )


def check_struct(name: str, recorded: Description, current: Description) -> list[str]:
    """The append-only violations of one struct (empty when it is compatible)."""
    problems: list[str] = []
    if not current["array_like"]:
        problems.append(f"{name}: is no longer array_like")
    if current["tag"] != recorded["tag"]:
        problems.append(f"{name}: tag changed from {recorded['tag']!r} to {current['tag']!r}")
    old, new = recorded["fields"], current["fields"]
    for index, field in enumerate(old):
        if index >= len(new):
            problems.append(f"{name}: field #{index} {_field_text(field)} was removed")
            continue
        now = new[index]
        if _retired(field, now):
            continue
        if (now["name"], now["type"]) != (field["name"], field["type"]):
            problems.append(
                f"{name}: field #{index} was {_field_text(field)}, is now {_field_text(now)} "
                "(fields may only be appended at the end)"
            )
        elif now["required"] and not field["required"]:
            problems.append(f"{name}: field #{index} {field['name']} lost its default")
    for index in range(len(old), len(new)):
        if new[index]["required"]:
            problems.append(f"{name}: appended field #{index} {new[index]['name']} needs a default")
    return problems


def check_append_only(
    recorded: Mapping[str, Description], current: Mapping[str, Description]
) -> list[str]:
    """All violations across structs; a recorded struct missing from ``current`` is one."""
    problems: list[str] = []
    for name, description in recorded.items():
        if name not in current:
            problems.append(f"{name}: struct was removed from the wire schema")
            continue
        problems.extend(check_struct(name, description, current[name]))
    return problems
