"""A real P0 on the tiny model in front of the scripted P1, started and stopped as one.

- :func:`tiny_settings` is the ``FrontendConfig`` every such P0 uses: the tiny model, served
  as ``tiny``, wired to ``engine``'s two ZMQ addresses (a ``FakeEngine`` or a real
  ``procs.Engine``); anything else is a keyword override.
- :func:`scripted_stack` starts a ``FakeEngine`` (``engine_options`` its keywords, with
  ``core`` in place of its default ``ScriptedCore`` when given), then a ``RunningFrontend`` on
  it, and yields both. On exit the front end is stopped before the engine, and the engine is
  stopped even when the front end failed to start, so no P1 thread or socket outlives the
  ``with`` block.
- :data:`StackFactory`: the type of ``conftest.py``'s ``start_stack`` fixture, which starts
  such stacks for one test (same arguments, less the directory) and stops them after it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from fake_engine import FakeEngine, RunningFrontend, ScriptedCore

from mmis.frontend.config import FrontendConfig
from mmis.telemetry.tracing import Tracing
from mmis.tiny_models.tiny_model import tiny_model_dir


class EngineAddresses(Protocol):
    input_address: str
    output_address: str


def tiny_settings(engine: EngineAddresses, **overrides: Any) -> FrontendConfig:
    return FrontendConfig(
        model=str(tiny_model_dir()),
        served_model_name="tiny",
        engine_input_address=engine.input_address,
        engine_output_address=engine.output_address,
        **overrides,
    )


@contextmanager
def scripted_stack(
    directory: Path,
    core: ScriptedCore | None = None,
    *,
    tracing: Tracing | None = None,
    engine_options: Mapping[str, Any] | None = None,
    **settings: Any,
) -> Iterator[tuple[FakeEngine, RunningFrontend]]:
    engine = FakeEngine(str(directory), **(engine_options or {}))
    if core is not None:
        engine.core = engine.proc.core = core
    engine.start()
    try:
        frontend = RunningFrontend(tiny_settings(engine, **settings), tracing=tracing).start()
        try:
            yield engine, frontend
        finally:
            frontend.stop()
    finally:
        engine.stop()


StackFactory = Callable[..., tuple[FakeEngine, RunningFrontend]]
