"""The one definition of every server setting, and the layers derived from it.

Invariants:
- Every setting of a process is a field of that process's one frozen settings dataclass
  (P1: ``mmis.engine.config.EngineConfig``, P0: ``mmis.frontend.config.FrontendConfig``),
  declared with :func:`setting`: its one default and its one help text live there. A setting
  both processes of a pod read (they must agree on it) is declared once in
  :data:`SHARED_SETTINGS` and used by both through :func:`shared`.
- Validation lives in the dataclass (``__post_init__``); its messages name the CLI flag.
- Derived, never restated: the argparse options (:func:`add_flags`; every option defaults to
  ``None`` so the dataclass stays the only default) and the environment layer
  (:func:`from_env`, ``MMIS_<SECTION>_<FIELD>``). ``tests/contract/test_settings_defaults.py``
  fails when any of them, or the operator, grows a default of its own.
- Precedence: explicit argument (CLI) > environment (``MMIS_<SECTION>_<FIELD>``) > default.
- Environment values are parsed by the field's declared type; a bad value raises
  :class:`ConfigError` naming the variable, never a bare ``ValueError`` later.
- A ``Mapping`` setting is written as a JSON object (env and CLI alike, through
  :func:`json_object`); anything else (bad JSON, a list, a number) is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from collections import abc
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

GiB = 1 << 30


class ConfigError(ValueError):
    pass


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    flags: tuple[str, ...] = (),
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    factory: Callable[[], Any] | None = None,
    shared_as: str | None = None,
) -> Any:
    """A settings field: its default (or ``factory``) and help, plus what :func:`add_flags`
    needs (``flags``: the option strings, first one canonical; default ``--field-name``)."""
    meta = {"help": help, "flags": flags, "metavar": metavar, "choices": choices}
    if shared_as is not None:
        meta["shared"] = shared_as
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


REVISION_HELP = (
    "model revision (branch, tag or commit) for every from_pretrained; "
    "ignored for a local directory"
)
# settings both P0 and P1 read, which the two must agree on: one definition, used by both
SHARED_SETTINGS: dict[str, dict[str, Any]] = {
    "revision": {"default": None, "metavar": "REV", "help": REVISION_HELP},
    "engine_input_address": {
        "default": "tcp://127.0.0.1:5570",
        "flags": ("--engine-input-address", "--input-address"),
        "help": "ZMQ address of the engine's request socket (P1 binds, P0 connects)",
    },
    "engine_output_address": {
        "default": "tcp://127.0.0.1:5571",
        "flags": ("--engine-output-address", "--output-address"),
        "help": "ZMQ address of the engine's output socket (P1 binds, P0 subscribes)",
    },
    "mm_cache_type": {
        "default": "lru",
        "choices": ("lru", "shm"),
        "help": "multimodal cache transport: lru (tensors inline over ZMQ) or shm",
    },
    "mm_cache_gb": {
        "default": 4.0,
        "help": "multimodal cache budget in GiB (P0's shadow and P1's receiver must match)",
    },
    "shm_dir": {"default": "/dev/shm", "help": "directory of the shared-memory store (shm)"},
    "max_model_len": {"default": None, "help": "context window (default: the model config's)"},
    "otlp_traces_endpoint": {
        "default": None,
        "help": "export request spans over OTLP to this endpoint (default: OTEL_* environment, "
        "e.g. OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; tracing is off when none is set)",
    },
    "log_level": {"default": "info", "help": "python logging level"},
}


def shared(name: str, **changes: Any) -> Any:
    """The field of shared setting ``name`` (``changes``: other option strings only)."""
    return setting(**{**SHARED_SETTINGS[name], **changes}, shared_as=name)


def default_of(cls: type, name: str) -> Any:
    """The one default of field ``name`` of settings class ``cls``."""
    (field,) = [f for f in dataclasses.fields(cls) if f.name == name]
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def flags_of(field: dataclasses.Field[Any]) -> tuple[str, ...]:
    return field.metadata.get("flags") or ("--" + field.name.replace("_", "-"),)


def flag_of(cls: type, name: str) -> str:
    """The canonical CLI flag of field ``name`` (for messages)."""
    (field,) = [f for f in dataclasses.fields(cls) if f.name == name]
    return flags_of(field)[0]


def _value_type(tp: Any) -> Any:
    """``X`` of ``X | None``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def _arg_type(tp: Any, flag: str) -> Callable[[str], Any]:
    def parse(raw: str) -> Any:
        try:
            return _parse(raw, tp, flag)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{flag}: ")) from None

    parse.__name__ = getattr(_value_type(tp), "__name__", "value")
    return parse


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    skip: Iterable[str] = (),
    dest_prefix: str = "",
) -> None:
    """One option per field of ``cls``, derived from the field (option strings, type, help);
    its default is ``None`` (unset), so the dataclass default is the only one. A ``bool``
    field's option stores the opposite of its default. Options named in ``skip`` are left
    out (a field whose every option is skipped gets none)."""
    taken = set(skip)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        options = [f for f in flags_of(field) if f not in taken]
        if not options:
            continue
        meta, tp = field.metadata, hints[field.name]
        default = default_of(cls, field.name)
        text = meta["help"]
        if tp is not bool and default not in (None, "", (), {}):
            text += f" (default: {default})"
        kwargs: dict[str, Any] = {"dest": dest_prefix + field.name, "default": None, "help": text}
        if tp is bool:
            kwargs.update(action="store_const", const=not default)
        else:
            metavar = meta["metavar"] or field.name.upper()
            kwargs.update(type=_arg_type(tp, options[0]), metavar=metavar)
            kwargs["choices"] = meta["choices"]
        parser.add_argument(*options, **kwargs)


def settings_from_args(cls: type[T], section: str, args: argparse.Namespace, prefix: str = "") -> T:
    """``cls`` from the parsed options of :func:`add_flags` over ``MMIS_<SECTION>_*``."""
    given = vars(args)
    return from_env(
        cls,
        section,
        **{f.name: given.get(prefix + f.name) for f in dataclasses.fields(cls)},  # type: ignore[arg-type]
    )


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
