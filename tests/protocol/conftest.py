"""Loads the golden samples module (by path: tests are not a package) for protocol tests.

Provides the ``golden`` fixture (the samples module) and parametrizes any test that takes a
``sample`` argument over every canonical sample.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest


def _load_golden() -> ModuleType:
    name = "mmis_golden_samples"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parent / "golden" / "samples.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


GOLDEN = _load_golden()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "sample" in metafunc.fixturenames:
        all_samples = GOLDEN.samples()
        metafunc.parametrize("sample", all_samples, ids=[s.name for s in all_samples])


@pytest.fixture
def golden() -> ModuleType:
    return GOLDEN
