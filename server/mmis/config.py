"""The one definition of every server setting, and the layers derived from it.

Invariants:
- Each setting of a process is one field, declared with :func:`setting` (its one default,
  help and rule), of that process's frozen dataclass: ``mmis.engine.config.EngineConfig``
  (P1), ``mmis.frontend.config.FrontendConfig`` (P0). A setting both must agree on is one
  :data:`SHARED_SETTINGS` entry, used by both through :func:`shared`.
- Derived, never restated: the argparse options (:func:`add_flags`, every default ``None``),
  the env layer (:func:`from_env`), validation (:func:`check`, naming the flag); checked by
  ``tests/contract/test_settings_defaults.py``.
- Precedence: explicit argument (CLI) > environment (``MMIS_<SECTION>_<FIELD>``) > default.
  Values are parsed by the field's type; a bad one raises :class:`ConfigError` naming the
  flag or variable. A ``Mapping`` is a JSON object (:func:`json_object`), nothing else.
- A start that cannot work for a reason other than a setting's value raises
  :class:`StartupError` (one line: the cause and the fix), never a bare exception.
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
    """A bad setting (a flag or variable's value); the message names it."""


class StartupError(RuntimeError):
    """A server command cannot start here: a model that is not there, a port in use, a
    ``/dev/shm`` too small, a device or dtype the machine lacks, a model family not supported,
    a KV cache too small for one request. Its message is ONE line naming the cause and the
    fix; every entry point (``mmis.cli``) prints it as ``mmis <command>: <message>`` with no
    traceback and exits 1, and ``mmis serve`` relays a child's line as its own last line
    (docs/operations/troubleshooting.md lists each)."""


Rule = tuple[Callable[[Any], bool], str]
POSITIVE: Rule = (lambda v: v is None or v > 0, "must be > 0")
NOT_NEGATIVE: Rule = (lambda v: v >= 0, "must be >= 0")
AT_LEAST_1: Rule = (lambda v: v >= 1, "must be at least 1")
CACHE_TYPE: Rule = (lambda v: v in ("lru", "shm"), "must be lru or shm")


def setting(
    default: Any = dataclasses.MISSING, *, help: str, factory: Any = None, **meta: Any
) -> Any:
    """A settings field: its one default (or ``factory``) and help, plus what :func:`add_flags`
    reads from ``meta``: ``flags`` (option strings, first canonical; default ``--field-name``),
    ``metavar``, ``choices``, ``shared`` (the :data:`SHARED_SETTINGS` name), ``words`` (a
    ``tuple[str, ...]`` flag taking one or more words, each an item: vLLM's ``--lora-modules
    a=x b=y``; its variable stays comma-separated), and ``rule`` (a predicate and what it
    requires, checked by :func:`check` in ``__post_init__``)."""
    meta["help"] = help
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# settings both P0 and P1 read, which the two must agree on: one definition, used by both
SHARED_SETTINGS: dict[str, dict[str, Any]] = {
    "revision": {
        "default": None,
        "metavar": "REV",
        "help": "model revision (branch, tag or commit) for every from_pretrained; "
        "ignored for a local directory",
    },
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
        "rule": CACHE_TYPE,
        "help": "multimodal cache transport: lru (inline over ZMQ) or shm",
    },
    "mm_cache_gb": {
        "default": 4.0,
        "rule": NOT_NEGATIVE,
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
    return setting(**{**SHARED_SETTINGS[name], **changes}, shared=name)


def _field(cls: type, name: str) -> dataclasses.Field[Any]:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def default_of(cls: type, name: str) -> Any:
    """The one default of field ``name`` of settings class ``cls``."""
    field = _field(cls, name)
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def flags_of(field: dataclasses.Field[Any]) -> tuple[str, ...]:
    return field.metadata.get("flags") or ("--" + field.name.replace("_", "-"),)


def flag_of(cls: type, name: str) -> str:
    """The canonical CLI flag of field ``name`` (for messages)."""
    return flags_of(_field(cls, name))[0]


def check(settings: Any) -> None:
    """:class:`ConfigError` naming the flag of the first field that breaks its ``rule``."""
    for field in dataclasses.fields(settings):
        ok, rule = field.metadata.get("rule", (None, ""))
        value = getattr(settings, field.name)
        if ok is not None and not ok(value):
            raise ConfigError(f"{flags_of(field)[0]} {rule}, got {value!r}")


def _arg_type(tp: Any, flag: str) -> Callable[[str], Any]:
    def parse(raw: str) -> Any:
        try:
            return _parse(raw, tp, flag)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{flag}: ")) from None

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
        elif meta.get("words"):  # one or more words, each one item (no comma split)
            kwargs.update(nargs="+", type=str, action=_Words, metavar=meta.get("metavar"))
        else:
            metavar = meta.get("metavar") or field.name.upper()
            kwargs.update(type=_arg_type(tp, options[0]), metavar=metavar)
            kwargs["choices"] = meta.get("choices")
        parser.add_argument(*options, **kwargs)


class _Words(argparse.Action):
    """A ``words`` flag's items as a tuple (repeating the flag adds more)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, (*(getattr(namespace, self.dest) or ()), *values))


def settings_from_args(cls: type[T], section: str, args: argparse.Namespace, prefix: str = "") -> T:
    """``cls`` from the parsed options of :func:`add_flags` over ``MMIS_<SECTION>_*``."""
    given = vars(args)
    return from_env(
        cls,
        section,
        **{f.name: given.get(prefix + f.name) for f in dataclasses.fields(cls)},  # type: ignore[arg-type]
    )


_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


def json_object(raw: str, name: str) -> dict[str, Any]:
    """``raw`` as a JSON object (a dict with string keys), or :class:`ConfigError` naming
    ``name`` (a flag or variable) and saying what is wrong."""
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(
            f"{name}: expected a JSON object, got invalid JSON {raw!r} ({exc})"
        ) from None
    if not isinstance(value, dict):
        kind = _JSON_KINDS.get(type(value), "null")
        raise ConfigError(
            f"{name}: expected a JSON object like '{{\"do_normalize\": false}}', "
            f"got a JSON {kind}: {raw!r}"
        )
    return value


def _parse(raw: str, tp: Any, name: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if raw.strip().lower() in ("", "none", "null"):
            return None
        return _parse(raw, args[0], name)
    if origin in (dict, abc.Mapping):
        return json_object(raw, name)
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
    cls: type[T], section: str, environ: Mapping[str, str] | None = None, **overrides: Any
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
