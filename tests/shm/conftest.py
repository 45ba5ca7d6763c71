"""Fixtures for the shared-memory store tests: writers in a private directory, always cleaned."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmis.shm import ShmWriter


class FakeClock:
    """A manual clock, so expiry deadlines are crossed by the test, never by sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "shm"
    directory.mkdir()
    yield directory
    leftovers = sorted(p.name for p in directory.iterdir())
    assert leftovers == [], f"segment files left behind: {leftovers}"


@pytest.fixture
def make_writer(shm_dir: Path) -> Iterator[Callable[..., ShmWriter]]:
    writers: list[ShmWriter] = []

    def make(capacity: int = 1 << 20, **kwargs: Any) -> ShmWriter:
        kwargs.setdefault("put_timeout_s", 0.0)
        writer = ShmWriter(capacity, directory=shm_dir, **kwargs)
        writers.append(writer)
        return writer

    yield make
    for writer in writers:
        writer.close()


def _image_payload(seed: int, side: int = 32) -> dict[str, np.ndarray]:
    """A processor-like tensor dict: pixel values plus the image grid metadata."""
    rng = np.random.default_rng(seed)
    return {
        "pixel_values": rng.standard_normal((3, side, side), dtype=np.float32),
        "image_grid_thw": np.array([[1, side // 14 + 1, side // 14 + 1]], dtype=np.int64),
    }


def _assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, arr in want.items():
        assert got[name].dtype == arr.dtype, name
        assert got[name].shape == arr.shape, name
        np.testing.assert_array_equal(got[name], arr)


@pytest.fixture
def image_payload() -> Callable[..., dict[str, np.ndarray]]:
    return _image_payload


@pytest.fixture
def assert_same() -> Callable[[dict[str, np.ndarray], dict[str, np.ndarray]], None]:
    return _assert_same
