"""``mmis engine`` as a command: settings from flags and ``MMIS_ENGINE_*``, clear refusals,
a clean exit on SIGTERM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_harness import EngineHarness

pytestmark = [pytest.mark.model]


def run_engine(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mmis", "engine", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--num-kv-blocks", "1"], {}, "--num-kv-blocks must be at least 2"),
        (["--fault-evict-rate", "2"], {}, "--fault-evict-rate must be within [0, 1]"),
        (["--kv-cache-gb", "0"], {}, "--kv-cache-gb must be positive"),
        ([], {"MMIS_ENGINE_MAX_NUM_SEQS": "many"}, "MMIS_ENGINE_MAX_NUM_SEQS='many'"),
    ],
)
def test_bad_settings_are_refused_with_a_clear_message(
    args: list[str], env: dict[str, str], message: str
) -> None:
    done = run_engine(*args, env=env)
    assert done.returncode != 0
    assert message in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_a_kv_budget_below_two_blocks_is_refused(tiny_dirs: dict[str, Path]) -> None:
    done = run_engine(
        "--model", str(tiny_dirs["llava"]), "--device", "cpu", "--kv-cache-gb", "1e-9"
    )
    assert done.returncode != 0
    assert "raise --kv-cache-gb" in done.stderr or "at least 2 are needed" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_env_settings_apply_and_sigterm_exits_cleanly(tiny_dirs: dict[str, Path]) -> None:
    env = {"MMIS_ENGINE_NUM_KV_BLOCKS": "20", "MMIS_ENGINE_BLOCK_SIZE": "8"}
    engine = EngineHarness(tiny_dirs["llava"], env=env)
    try:
        engine.start()
        stats = engine.call("stats")
        assert stats["num_kv_blocks"] == 19
        assert "engine ready: 20 KV blocks of 8 tokens" in engine.log_text()
    finally:
        code = engine.stop()
        engine.close()
    assert code == 0
