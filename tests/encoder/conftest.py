"""The session's ``mmis encoder`` processes (one per family: ``encoder_procs.py``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from encoder_procs import Client, EncoderProc

from mmis.tiny_models.tiny_model import tiny_model_dir


@pytest.fixture(scope="session")
def encoder_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("encoders")


def _encoder(family: str, log_dir: Path, *extra: str) -> Iterator[EncoderProc]:
    proc = EncoderProc(f"encoder-{family}", tiny_model_dir(family), log_dir, *extra)
    yield proc
    code = proc.stop()
    assert code == 0, f"SIGTERM: exit {code}, not 0\n{proc.log_tail()}"


@pytest.fixture(scope="session")
def llava_encoder(encoder_logs: Path) -> Iterator[EncoderProc]:
    events = ("--events-endpoint", "tcp://127.0.0.1:0")
    yield from _encoder(
        "llava", encoder_logs, *events, "--events-replay-endpoint", "tcp://127.0.0.1:0"
    )


@pytest.fixture(scope="session")
def qwen_encoder(encoder_logs: Path) -> Iterator[EncoderProc]:
    yield from _encoder("qwen2-vl", encoder_logs)


@pytest.fixture
def client(llava_encoder: EncoderProc) -> Iterator[Client]:
    c = Client(llava_encoder.endpoint)
    yield c
    c.close()
