"""S9 insertion detection: each wire struct's current fields START WITH the fields recorded
in every checked-in version's schema.json; and the checker itself rejects a field inserted
in the middle (or removed, reordered, retyped, re-tagged) while accepting an appended one."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from mmis.protocol import WIRE_STRUCTS, check_append_only, describe_all
from mmis.protocol.schema import check_struct, describe, type_name


def test_checked_in_schemas_are_prefixes_of_the_current_structs(golden) -> None:
    current = describe_all()
    for version in golden.versions():
        recorded = json.loads((golden.GOLDEN_DIR / version / "schema.json").read_text())
        assert set(recorded) <= set(current)
        assert check_append_only(recorded, current) == [], version


def test_schema_covers_every_wire_struct(golden) -> None:
    path = golden.GOLDEN_DIR / golden.CURRENT_VERSION / "schema.json"
    assert set(json.loads(path.read_text())) == {s.__name__ for s in WIRE_STRUCTS}


class Base(msgspec.Struct, array_like=True):
    request_id: str
    token_ids: list[int]
    priority: int = 0


class Appended(msgspec.Struct, array_like=True):
    request_id: str
    token_ids: list[int]
    priority: int = 0
    lora_name: str | None = None


class Inserted(msgspec.Struct, array_like=True):
    request_id: str
    lora_name: str | None = None
    token_ids: list[int] = msgspec.field(default_factory=list)
    priority: int = 0


class Reordered(msgspec.Struct, array_like=True):
    token_ids: list[int]
    request_id: str
    priority: int = 0


class Removed(msgspec.Struct, array_like=True):
    request_id: str
    priority: int = 0


class Retyped(msgspec.Struct, array_like=True):
    request_id: str
    token_ids: list[float]
    priority: int = 0


class AppendedRequired(msgspec.Struct, array_like=True):
    request_id: str
    token_ids: list[int]
    priority: int
    lora_name: str


class Tagged(msgspec.Struct, array_like=True, tag="base"):
    request_id: str
    token_ids: list[int]
    priority: int = 0


class Retired(msgspec.Struct, array_like=True, kw_only=True):
    request_id: str
    _token_ids: list[int] = msgspec.field(default_factory=list)
    priority: int = 0


class RetiredRetyped(msgspec.Struct, array_like=True, kw_only=True):
    request_id: str
    _token_ids: list[float] = msgspec.field(default_factory=list)
    priority: int = 0


class RetiredRequired(msgspec.Struct, array_like=True, kw_only=True):
    request_id: str
    _token_ids: list[int]
    priority: int = 0


class AsMap(msgspec.Struct):
    request_id: str
    token_ids: list[int]
    priority: int = 0


def _check(variant: type[msgspec.Struct]) -> list[str]:
    return check_struct("Base", describe(Base), describe(variant))


def test_checker_accepts_a_field_appended_with_a_default() -> None:
    assert _check(Base) == []
    assert _check(Appended) == []


def test_checker_rejects_a_field_inserted_in_the_middle() -> None:
    problems = _check(Inserted)
    assert problems, "an inserted field must be rejected"
    assert any("field #1 was token_ids: list[int], is now lora_name" in p for p in problems)


@pytest.mark.parametrize(
    ("variant", "needle"),
    [
        (Reordered, "field #0 was request_id: str, is now token_ids"),
        (Removed, "field #2 priority: int was removed"),
        (Retyped, "is now token_ids: list[float]"),
        (AppendedRequired, "priority lost its default"),
        (AppendedRequired, "appended field #3 lora_name needs a default"),
        (Tagged, "tag changed from None to 'base'"),
        (AsMap, "no longer array_like"),
    ],
    ids=["reordered", "removed", "retyped", "lost-default", "required-append", "tag", "map"],
)
def test_checker_rejects_other_breaking_changes(variant: type[msgspec.Struct], needle: str) -> None:
    problems = _check(variant)
    assert any(needle in p for p in problems), problems


def test_checker_accepts_a_field_retired_in_place() -> None:
    assert _check(Retired) == []
    old = msgspec.msgpack.encode(Base("r", [1, 2], 3))
    decoded = msgspec.msgpack.decode(old, type=Retired)  # a retired slot still decodes
    assert (decoded.request_id, decoded.priority) == ("r", 3)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(Retired(request_id="r")), type=Base) == (
        Base("r", [], 0)
    )


@pytest.mark.parametrize(
    ("variant", "needle"),
    [
        (RetiredRetyped, "field #1 was token_ids: list[int], is now _token_ids: list[float]"),
        (RetiredRequired, "field #1 was token_ids: list[int], is now _token_ids: list[int]"),
    ],
    ids=["retyped", "required"],
)
def test_checker_rejects_a_retirement_that_breaks_the_slot(
    variant: type[msgspec.Struct], needle: str
) -> None:
    assert any(needle in p for p in _check(variant)), _check(variant)


def test_checker_reports_a_removed_struct() -> None:
    recorded = {"Base": describe(Base), "Gone": describe(Base)}
    assert check_append_only(recorded, {"Base": describe(Appended)}) == [
        "Gone: struct was removed from the wire schema"
    ]


NAME = "inserted_by_test"


def _variant(struct: type[msgspec.Struct], position: int) -> type[msgspec.Struct]:
    """``struct`` rebuilt with a field ``NAME: int`` inserted at ``position`` (with a default
    ``0`` where the fields after it all have defaults, as Python requires)."""
    fields: list[Any] = []
    for info in msgspec.structs.fields(struct):
        if info.default_factory is not msgspec.NODEFAULT:
            fields.append(
                (info.name, info.type, msgspec.field(default_factory=info.default_factory))
            )
        elif info.default is not msgspec.NODEFAULT:
            fields.append((info.name, info.type, info.default))
        else:
            fields.append((info.name, info.type))
    later_required = any(len(field) == 2 for field in fields[position:])
    fields.insert(position, (NAME, int) if later_required else (NAME, int, 0))
    config = struct.__struct_config__
    return msgspec.defstruct(
        struct.__name__,
        fields,
        array_like=True,
        kw_only=True,  # a retired slot (optional) may sit before required fields
        tag=config.tag,
        tag_field=config.tag_field,
    )


@pytest.mark.parametrize("struct", WIRE_STRUCTS, ids=lambda s: s.__name__)
def test_insertion_into_a_real_wire_struct_is_caught(golden, struct) -> None:
    """Against the checked-in schema: inserting before the last field fails, appending passes."""
    recorded = json.loads((golden.GOLDEN_DIR / golden.CURRENT_VERSION / "schema.json").read_text())
    current = describe_all()
    n_fields = len(struct.__struct_fields__)
    for position in range(n_fields):
        inserted = {**current, struct.__name__: describe(_variant(struct, position))}
        assert check_append_only(recorded, inserted), f"insertion at {position} not caught"
    appended = {**current, struct.__name__: describe(_variant(struct, n_fields))}
    assert check_append_only(recorded, appended) == []


@pytest.mark.parametrize(
    ("tp", "text"),
    [
        (int, "int"),
        (dict[str, Any] | None, "dict[str, Any] | None"),
        (list[int], "list[int]"),
        (tuple[int, ...], "tuple[int, ...]"),
        (str | int | None, "str | int | None"),
    ],
)
def test_type_names_are_stable(tp: Any, text: str) -> None:
    assert type_name(tp) == text
