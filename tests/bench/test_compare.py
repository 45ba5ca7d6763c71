"""``mmis bench compare`` (``mmis.bench.compare``): ratios B / A and which side is better, per
figure; a side that completed nothing has no latency ratio; a file that is no result is a
one-line error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmis.bench.compare import compare_rows, format_table, print_compare

A = {
    "request_throughput": 10.0,
    "output_throughput": 100.0,
    "mean_ttft_ms": 50.0,
    "p99_ttft_ms": 80.0,
    "std_ttft_ms": 5.0,
    "completed": 20,
    "failed": 0,
}
B = {
    "request_throughput": 20.0,
    "output_throughput": 99.5,
    "mean_ttft_ms": 100.0,
    "p99_ttft_ms": 40.0,
    "std_ttft_ms": 9.0,
    "completed": 20,
    "failed": 2,
}


def test_rows_ratios_and_better_side() -> None:
    rows = {k: (ratio, better) for k, _, _, ratio, better in compare_rows(A, B)}
    assert rows == {
        "request_throughput": ("2.00x", "B"),
        "output_throughput": ("0.99x", "="),  # within 1%
        "mean_ttft_ms": ("2.00x", "A"),  # a latency: higher is worse
        "p99_ttft_ms": ("0.50x", "B"),
        "completed": ("1.00x", "="),
        "failed": ("-", "A"),  # over a zero A
    }


def test_a_side_without_completions_has_no_latency_ratio() -> None:
    dead = dict(B, completed=0, failed=20, mean_ttft_ms=0.0, p99_ttft_ms=0.0)
    rows = {k: (ratio, better) for k, _, _, ratio, better in compare_rows(A, dead)}
    assert rows["mean_ttft_ms"] == ("-", "-") and rows["request_throughput"] == ("-", "-")
    assert rows["completed"] == ("0.00x", "A")


def test_table_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.json").write_text(json.dumps(A))
    (tmp_path / "b.json").write_text(json.dumps(B))
    assert print_compare(tmp_path / "a.json", tmp_path / "b.json") == 0
    out = capsys.readouterr().out
    assert (
        out
        == format_table(compare_rows(A, B), str(tmp_path / "a.json"), str(tmp_path / "b.json"))
        + "\n"
    )
    assert "request_throughput" in out and "2.00x" in out
    (tmp_path / "c.json").write_text("[1, 2]")
    assert print_compare(tmp_path / "a.json", tmp_path / "c.json") == 2
    assert "not a bench serve result" in capsys.readouterr().err
