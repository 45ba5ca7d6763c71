"""The request-walk tracer: loaded by every Python process started with this folder on
``PYTHONPATH`` and ``MMIS_WALK_TRACE`` naming a control folder (``tests/e2e/test_request_walk.py``
starts ``mmis serve`` so; its engine child inherits both, so P0 and P1 are traced alike).

Invariants:
- A profile hook (``sys.setprofile`` here, ``threading.setprofile`` for every later thread) is
  installed before any server code runs, and records nothing until a *window* is opened: only
  what runs after start-up counts.
- A window is opened and closed through the control folder, never by a signal (no server
  signal handler is touched): the test writes ``control`` (``start NAME`` / ``stop NAME``); a
  watcher thread of each process sees it within ~50 ms, opens the window (acknowledged by
  ``NAME.PID.started``) or closes it and writes ``NAME.PID.json``: every code object called in
  the window, once, as its file and qualified name, and the *crossings*: calls from a frame of
  ``MMIS_WALK_CLIENT`` code into ``MMIS_WALK_API`` code (``client`` calling back into ``api``),
  and entries into ``client`` code from outside it (``api`` directly, or a task ``api``
  created) whose arguments carry a callable defined in ``api`` (two levels deep: containers,
  object fields).
- Every process announces itself on start with ``PID.pid`` (its argv), so the test knows whom
  to wait for.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from types import FrameType
from typing import Any

_ON = False
_SEEN: set[tuple[str, str]] = set()  # (file, qualified name) of every code object called
_CROSSINGS: set[str] = set()
_API = os.environ.get("MMIS_WALK_API", "\0")
_CLIENT = os.environ.get("MMIS_WALK_CLIENT", "\0")


def _defined_in_api(value: Any) -> bool:
    """Whether ``value`` is a callable whose code lives in an ``api`` module."""
    if isinstance(value, functools.partial):
        value = value.func
    value = getattr(value, "__func__", value)  # a bound method: its function
    code = getattr(value, "__code__", None)
    if code is not None:
        return str(code.co_filename).startswith(_API)
    if callable(value) and not isinstance(value, type):
        call = getattr(type(value), "__call__", None)  # noqa: B004 - an instance's own __call__
        code = getattr(call, "__code__", None)
        return code is not None and str(code.co_filename).startswith(_API)
    return False


def _handed(value: Any, depth: int = 0) -> list[Any]:
    """``value`` and what it carries (containers, dataclass and object fields), two levels."""
    found = [value]
    if depth >= 2:
        return found
    if isinstance(value, dict):
        inner: list[Any] = list(value.values())
    elif isinstance(value, list | tuple | set | frozenset):
        inner = list(value)
    else:
        fields = getattr(value, "__dict__", None)
        slots = getattr(type(value), "__slots__", ())
        inner = list(fields.values()) if isinstance(fields, dict) else []
        inner += [getattr(value, s, None) for s in slots if isinstance(s, str)]
    for item in inner[:64]:
        found += _handed(item, depth + 1)
    return found


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    if not _ON or event != "call":
        return
    code = frame.f_code
    name = code.co_filename
    _SEEN.add((name, code.co_qualname))
    caller = frame.f_back
    if caller is None:
        return
    where = caller.f_code.co_filename
    if name.startswith(_API) and where.startswith(_CLIENT):
        _CROSSINGS.add(f"client calls api: {where}:{caller.f_lineno} -> {name}:{code.co_name}")
    elif name.startswith(_CLIENT) and not where.startswith(_CLIENT):
        # entering client from outside it: api directly, or a task api created (asyncio)
        count = code.co_argcount + code.co_kwonlyargcount
        for arg_name in code.co_varnames[:count]:
            value = frame.f_locals.get(arg_name)
            if any(_defined_in_api(v) for v in _handed(value)):
                _CROSSINGS.add(
                    f"api hands client a callable: {where} -> {name}:{code.co_name}({arg_name}=...)"
                )


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _watch(folder: str) -> None:
    global _ON
    control = os.path.join(folder, "control")
    pid = os.getpid()
    last = ""
    while True:
        time.sleep(0.05)
        try:
            with open(control) as f:
                command = f.read().strip()
        except OSError:
            continue
        if command == last:
            continue
        last = command
        action, _, name = command.partition(" ")
        if action == "start":
            _SEEN.clear()
            _CROSSINGS.clear()
            _ON = True
            _write(os.path.join(folder, f"{name}.{pid}.started"), "")
        elif action == "stop":
            _ON = False
            result = {"calls": sorted(_SEEN), "crossings": sorted(_CROSSINGS)}
            _write(os.path.join(folder, f"{name}.{pid}.json"), json.dumps(result))


def _install(folder: str) -> None:
    _write(os.path.join(folder, f"{os.getpid()}.pid"), json.dumps(sys.argv))
    threading.setprofile(_profile)
    sys.setprofile(_profile)
    threading.Thread(target=_watch, args=(folder,), name="walk-trace", daemon=True).start()


if os.environ.get("MMIS_WALK_TRACE"):
    _install(os.environ["MMIS_WALK_TRACE"])
