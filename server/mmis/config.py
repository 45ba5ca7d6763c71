"""Frozen configuration dataclasses and the one typed environment-variable layer.

Invariants:
- Every setting has exactly one default, in its dataclass.
- Precedence: explicit argument (CLI) > environment (``MMIS_<SECTION>_<FIELD>``) > default.
- Environment values are parsed by the field's declared type; a bad value raises
  :class:`ConfigError` naming the variable, never a bare ``ValueError`` later.
- A ``Mapping`` setting is written as a JSON object (env and CLI alike, through
  :func:`parse_json_object`); anything else (bad JSON, a list, a number) is refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from collections import abc
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")

GiB = 1 << 30


class ConfigError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Multimodal cache settings shared by P0 (sender shadow) and P1 (receiver)."""

    type: str = "lru"  # "lru" | "shm"
    gb: float = 4.0  # P0 shadow budget, and P1's unless engine_gb is set
    engine_gb: float | None = None  # P1 budget override (drift scenario S1a)
    shm_dir: str = "/dev/shm"
    shm_gb: float = 1.0
    hash_algorithm: str = "blake3"  # "blake3" | "sha256"

    @property
    def sender_bytes(self) -> int:
        return int(self.gb * GiB)

    @property
    def receiver_bytes(self) -> int:
        return int((self.gb if self.engine_gb is None else self.engine_gb) * GiB)


_JSON_KINDS: dict[type, str] = {
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def json_object(raw: str) -> dict[str, Any]:
    """``raw`` as a JSON object (a dict with string keys); ``ValueError`` saying what is wrong
    (without naming the setting: callers add the flag or variable)."""
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"expected a JSON object, got invalid JSON {raw!r} ({exc})") from None
    if not isinstance(value, dict):
        kind = _JSON_KINDS.get(type(value), type(value).__name__)
        raise ValueError(
            f"expected a JSON object like '{{\"do_normalize\": false}}', got a JSON {kind}: {raw!r}"
        )
    return value


def parse_json_object(raw: str, name: str) -> dict[str, Any]:
    """:func:`json_object`, or :class:`ConfigError` naming ``name`` (a flag or variable)."""
    try:
        return json_object(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _parse(raw: str, tp: Any, name: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if raw.strip().lower() in ("", "none", "null"):
            return None
        return _parse(raw, args[0], name)
    if origin in (dict, abc.Mapping):
        return parse_json_object(raw, name)
    try:
        if tp is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if tp in (int, float, str):
            return tp(raw)
        if origin in (list, tuple):
            (item,) = typing.get_args(tp)[:1]
            values = [_parse(v, item, name) for v in raw.split(",") if v.strip()]
            return values if origin is list else tuple(values)
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r} is not a valid {getattr(tp, '__name__', tp)}") from exc
    raise ConfigError(f"{name}: unsupported setting type {tp}")


def from_env(
    cls: type[T],
    section: str,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> T:
    """Build ``cls`` from defaults, then ``MMIS_<SECTION>_<FIELD>`` variables, then overrides.

    Overrides whose value is ``None`` are ignored, so argparse results can be passed as is.
    """
    env = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        var = f"MMIS_{section}_{field.name}".upper()
        if var in env:
            values[field.name] = _parse(env[var], hints[field.name], var)
    unknown = set(overrides) - set(hints)
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} settings: {sorted(unknown)}")
    values.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**values)
