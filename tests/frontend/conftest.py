"""Fixtures shared by the front-end modules (the scripted P1 of ``fake_engine.py``, real P0).

- :func:`start_stack` (function): ``engine, frontend = start_stack(core, tracing=...,
  engine_options={...}, **settings)`` starts :func:`scripted_stack.scripted_stack` (a
  ``FakeEngine`` and a ``RunningFrontend`` on it; the ``FrontendConfig`` overrides as
  keywords), each stack in a directory of its own under ``tmp_path``, and stops every stack
  it started after the test, front end before engine. Per test on purpose: its users read
  counters and caches that a fresh stack starts at zero, or drive the engine's knobs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine, RunningFrontend, ScriptedCore
from scripted_stack import StackFactory, scripted_stack

from mmis.telemetry.tracing import Tracing


@pytest.fixture
def start_stack(tmp_path: Path) -> Iterator[StackFactory]:
    with ExitStack() as started:
        count = 0

        def start(
            core: ScriptedCore | None = None,
            *,
            tracing: Tracing | None = None,
            engine_options: dict[str, Any] | None = None,
            **settings: Any,
        ) -> tuple[FakeEngine, RunningFrontend]:
            nonlocal count
            directory = tmp_path if count == 0 else tmp_path / f"stack-{count}"
            directory.mkdir(exist_ok=True)
            count += 1
            running = scripted_stack(
                directory, core, tracing=tracing, engine_options=engine_options, **settings
            )
            return started.enter_context(running)

        yield start
