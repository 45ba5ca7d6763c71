"""The one real server of the ``mmis bench`` tests: ``mmis serve`` on the tiny LLaVA (served as
``tiny``, one OpenMP thread), started once per session and stopped after it (``procs.Proc``,
the e2e tests' process wrapper: offline, its log in the session's temporary folder)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from procs import Proc

from mmis.tiny_models.tiny_model import tiny_model_dir


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    args = ["serve", "--port", "0", "--model", str(tiny_model_dir()), "--served-model-name", "tiny"]
    proc = Proc(
        "bench-serve-tiny",
        args,
        tmp_path_factory.mktemp("bench-serve"),
        {"OMP_NUM_THREADS": "1"},
        announces=True,
    )
    try:
        proc.wait_http("/ready", 300)
        yield proc
    finally:
        proc.stop()
