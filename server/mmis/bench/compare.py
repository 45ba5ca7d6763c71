"""``mmis bench compare A.json B.json``: two saved ``mmis bench serve`` results side by side.

One row per figure both files hold (the throughputs, then each latency statistic, then
``completed`` / ``failed``), with A's value, B's value and the ratio B / A. A ratio above 1
is better for a throughput and worse for a latency; the last column says which side is better
(``B``, ``A``, or ``=`` within 1%). Also reads ``vllm bench serve``'s JSON: the keys are its.
A ratio over a zero A is shown as ``-``, and so is every latency and throughput ratio when
one side completed no request (its figures are zeros, not measurements).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HIGHER_IS_BETTER = (
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "completed",
)
COUNTS = ("completed", "failed")


class CompareError(ValueError):
    """A file that is not a saved result (the message names it)."""


def load_result(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CompareError(f"{path}: not a readable JSON result ({exc})") from exc
    if not isinstance(data, dict) or "request_throughput" not in data:
        raise CompareError(f"{path}: no request_throughput; not a bench serve result")
    return data


def _latency_keys(data: dict[str, Any]) -> list[str]:
    """The latency statistics but ``std`` (and ``p50``, which repeats ``median``)."""
    return [
        k
        for k, v in data.items()
        if k.endswith("_ms")
        and isinstance(v, int | float)
        and k.split("_", 1)[0] != "std"
        and not (k.startswith("p50_") and "median_" + k[4:] in data)
    ]


def compare_rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, float, float, str, str]]:
    """``(figure, A, B, B/A as text, better side)`` for each figure both results hold."""
    keys = [k for k in HIGHER_IS_BETTER if k != "completed"]
    keys += [k for k in _latency_keys(a) if k in b]
    keys += list(COUNTS)
    rows = []
    for key in keys:
        va, vb = a.get(key), b.get(key)
        if not isinstance(va, int | float) or not isinstance(vb, int | float):
            continue
        if key not in COUNTS and not (a.get("completed") and b.get("completed")):
            rows.append((key, float(va), float(vb), "-", "-"))  # a side measured nothing
            continue
        ratio = f"{vb / va:.2f}x" if va else "-"
        if abs(vb - va) <= 0.01 * max(abs(va), abs(vb)):
            better = "="
        elif (vb > va) == (key in HIGHER_IS_BETTER):
            better = "B"
        else:
            better = "A"
        rows.append((key, float(va), float(vb), ratio, better))
    return rows


def _number(key: str, value: float) -> str:
    return str(int(value)) if key in COUNTS else f"{value:.2f}"


def format_table(rows: list[tuple[str, float, float, str, str]], a_name: str, b_name: str) -> str:
    head = ("figure", "A", "B", "B/A", "better")
    body = [(k, _number(k, va), _number(k, vb), r, w) for k, va, vb, r, w in rows]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(5)]
    lines = [f"A: {a_name}", f"B: {b_name}"]
    for row in [head, *body]:
        lines.append(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    return "\n".join(lines)


def print_compare(a_path: Path, b_path: Path) -> int:
    """Print the table; 0, or 2 with one line when a file is not a result."""
    try:
        a, b = load_result(a_path), load_result(b_path)
    except CompareError as exc:
        print(f"mmis bench compare: {exc}", file=sys.stderr)
        return 2
    print(format_table(compare_rows(a, b), str(a_path), str(b_path)))
    return 0
