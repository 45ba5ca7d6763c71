"""Imports that work in this tree and in trees from before the engine's split into
``engine/scheduling`` and ``engine/execution`` (commit d221bcc), for the benchmarks that time
an older tree beside this one (``bench_engine_medium.py --against DIR``,
``PYTHONPATH=OLD/server .venv/bin/python benchmarks/bench_host_step.py``).

Invariant: :func:`module` imports this tree's name first and falls back to the old name only
when the new module does not exist (any other import error propagates).
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType
from typing import Any

MOVED = {  # this tree's module -> its name before the split
    "mmis.engine.builder": "mmis.entrypoints.engine",
    "mmis.engine.execution.cpu_linear": "mmis.engine.cpu_linear",
    "mmis.engine.execution.decode_graphs": "mmis.engine.decode_graphs",
    "mmis.engine.execution.host_memory": "mmis.engine.host_memory",
    "mmis.engine.execution.model": "mmis.engine.model",
    "mmis.engine.execution.paged_attention": "mmis.engine.paged_attention",
    "mmis.engine.execution.runner": "mmis.engine.runner",
    "mmis.tiny_models.tiny_model": "mmis.engine.tiny_model",
}


def module(name: str) -> ModuleType:
    """``name`` imported from this tree, or its old name's module in an older tree."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        old = MOVED.get(name)
        if old is None or exc.name is None or not name.startswith(exc.name):
            raise
        return importlib.import_module(old)


def add_request(core: Any, request: Any) -> None:
    """``core.add_request`` with the request's items carrying their tensors (this tree), or
    with the tensors as a list beside it (trees before 2026-12-05)."""
    if len(inspect.signature(core.add_request).parameters) == 1:
        core.add_request(request)
    else:
        core.add_request(request, [feature.data for feature in request.mm_features])
