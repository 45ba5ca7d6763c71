"""``mmis bench serve`` end to end: the real command (a subprocess of the installed ``mmis``)
against a real ``mmis serve`` on the tiny model, closed loop at concurrency 2, the results
JSON checked against the server's own token counter; a wrong model fails every request,
counted by status, with a nonzero exit and one line naming the cause. Importing the command
loads no torch (the plain install runs it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from procs import MMIS, Proc, series

from mmis.bench.serve import request_models

TOKENS = "mmis_generation_tokens_total"


def bench(server: Proc, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        *MMIS, "bench", "serve", "--base-url", server.root_url, "--num-prompts", "6",
        "--dataset-name", "random-mm", "--random-mm-num-images", "1", "--random-mm-width", "64",
        "--random-mm-height", "64", "--random-input-len", "8", "--random-output-len", "8",
        "--max-concurrency", "2", "--save-result", "--result-dir", str(tmp_path),
        "--result-filename", "result.json", *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_closed_loop_against_mmis_serve(tiny_server: Proc, tmp_path: Path) -> None:
    before = series(tiny_server, TOKENS, model="tiny")
    run = bench(tiny_server, tmp_path, "--model", "tiny", "--goodput", "ttft:60000")
    assert run.returncode == 0, run.stderr
    generated = series(tiny_server, TOKENS, model="tiny") - before
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["completed"], result["failed"], result["errors_by_status"]) == (6, 0, {})
    assert result["max_concurrency"] == 2 and result["request_rate"] == "inf"
    assert len(result["ttfts"]) == 6 and all(t > 0 for t in result["ttfts"])
    assert result["output_tokens_from_usage"] is True
    assert result["total_output_tokens"] == sum(result["output_lens"]) == generated > 0
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
    assert result["request_goodput"] == result["request_throughput"]
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "p90_e2el_ms"):
        assert result[key] > 0, key
    assert "Serving Benchmark Result" in run.stdout and "6/6 requests, 0 failed" in run.stderr


def test_wrong_model_fails_every_request_counted_by_status(
    tiny_server: Proc, tmp_path: Path
) -> None:
    run = bench(tiny_server, tmp_path, "--model", "no-such-model")
    assert run.returncode == 1
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["completed"], result["failed"], result["errors_by_status"]) == (0, 6, {"404": 6})
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "mmis bench serve: all 6 requests failed (404: 6); first error: HTTP 404"
    )
    assert "no-such-model" in last


def test_bench_imports_no_torch() -> None:
    code = (
        "import sys, mmis.cli, mmis.entrypoints.bench, mmis.bench.serve, mmis.bench.compare; "
        "bad = [m for m in sys.modules if m.split('.')[0] == 'torch' "
        "or m.startswith(('mmis.engine', 'mmis.frontend'))]; print(bad); sys.exit(bool(bad))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_lora_modules_name_each_requests_model(tiny_server: Proc, tmp_path: Path) -> None:
    # the server serves "tiny" and no adapter "nope": the requests drawn "nope" (seeded, as
    # request_models draws them) are exactly the 404s, each naming it
    run = bench(tiny_server, tmp_path, "--lora-modules", "tiny", "nope", "--seed", "3")
    result = json.loads((tmp_path / "result.json").read_text())
    names = request_models(6, "tiny", ["tiny", "nope"], "random", 3)
    assert 0 < names.count("nope") < 6 and run.returncode == 0, run.stderr
    assert result["lora_modules"] == ["tiny", "nope"] and result["lora_assignment"] == "random"
    assert result["lora_requests"] == {"tiny": names.count("tiny"), "nope": names.count("nope")}
    assert result["errors_by_status"] == {"404": names.count("nope")}
    failed = [i for i, error in enumerate(result["errors"]) if error]
    assert failed == [i for i, n in enumerate(names) if n == "nope"]
    assert all("nope" in result["errors"][i] for i in failed)
