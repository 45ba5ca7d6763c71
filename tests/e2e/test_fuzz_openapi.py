"""Schemathesis fuzzes a real ``mmis serve`` against the server's own ``GET /openapi.json``.

- One ``mmis serve`` on the tiny model with small limits (``--max-model-len 48 --max-n 2``)
  and an API key. The document states those limits (``server/mmis/frontend/api/openapi.py``), so
  the largest valid generation the fuzzer can ask for is short; bigger values must be a 400.
- ``st run`` (schemathesis' CLI, a subprocess) over every operation of the document: phases
  examples and fuzzing, a fixed seed, at most :data:`MAX_EXAMPLES` cases per operation, no
  response-time limit. Checks: ``not_a_server_error`` (no 5xx),
  ``status_code_conformance``, ``content_type_conformance``,
  ``response_schema_conformance`` (streams event by event) and ``negative_data_rejection``
  (a body the document calls invalid must be refused: the schemas say what is refused).
  Any failure, or any error of the fuzzer itself, fails the test with schemathesis' report.
- Bounded for CI (about 2 minutes on two cores, the server's start included).
  ``SCHEMATHESIS_LONG=1`` runs the long run instead: the coverage phase too (every boundary
  and every documented value of every field: several hundred cases per generation route),
  :data:`LONG_EXAMPLES` cases per operation, fuzzing repeated for :data:`LONG_SECONDS`.
- The figures (cases per operation, duration, failures) are printed and recorded as test
  properties (``fuzz_cases``, ``fuzz_seconds``, ``fuzz_failures``).

The fuzzer runs under :data:`LAUNCHER`, which works around a CPython 3.11.7 bug (gh-106905:
``ast.parse`` deep in the stack raises ``SystemError``), hit when Hypothesis describes one
of its lambdas; only that description is affected, never what is generated or checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from procs import Proc, ServeFactory

from mmis.tiny_models.tiny_model import tiny_model_dir

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(1500)]

KEY = "sk-fuzz"
SEED = 20261201
MAX_EXAMPLES = 30
LONG = os.environ.get("SCHEMATHESIS_LONG") == "1"
LONG_EXAMPLES = 300
LONG_SECONDS = 600
CHECKS = (
    "negative_data_rejection",
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
)

LAUNCHER = """
import sys
from hypothesis.internal import lambda_sources

_describe = lambda_sources.lambda_description

def _described(f):
    try:
        return _describe(f)
    except SystemError:  # CPython 3.11.7, gh-106905: ast.parse deep in the stack
        return "lambda: <not described>"

lambda_sources.lambda_description = _described
from schemathesis.cli import schemathesis
sys.argv[0] = "st"
sys.exit(schemathesis())
"""


@pytest.fixture(scope="module")
def server(start_serve: ServeFactory) -> Iterator[Proc]:
    flags = ["--model", str(tiny_model_dir()), "--served-model-name", "tiny"]
    flags += ["--max-model-len", "48", "--max-n", "2", "--api-key", KEY]
    with start_serve("fuzz-serve", *flags) as serve:
        yield serve


def run_schemathesis(url: str, out: Path, *extra: str) -> tuple[int, str, dict[str, Any]]:
    """``st run`` against ``url``; its exit code, output and JSON report."""
    examples = LONG_EXAMPLES if LONG else MAX_EXAMPLES
    args = [
        "run",
        url,
        "--header",
        f"Authorization: Bearer {KEY}",
        "--checks",
        ",".join(CHECKS),
        "--phases",
        "examples,coverage,fuzzing" if LONG else "examples,fuzzing",
        "--max-examples",
        str(examples),
        "--seed",
        str(SEED),
        "--workers",
        "2",
        "--request-timeout",
        "120",
        "--generation-database",
        "none",
        "--suppress-health-check",
        "too_slow,filter_too_much",
        "--no-color",
        "--report",
        "json,ndjson",
        "--report-dir",
        str(out),
        *(["--max-time", str(LONG_SECONDS)] if LONG else []),
        *extra,
    ]
    done = subprocess.run(
        [sys.executable, "-c", LAUNCHER, *args],
        cwd=out,
        capture_output=True,
        text=True,
        timeout=LONG_SECONDS * 2 if LONG else 600,
        check=False,
    )
    reports = list(out.glob("*.json"))
    report = json.loads(reports[0].read_text()) if reports else {}
    return done.returncode, done.stdout + done.stderr, report


def cases_per_operation(out: Path) -> Counter[str]:
    """Test cases run per operation, counted from the ndjson event stream."""
    counts: Counter[str] = Counter()
    for path in out.glob("*.ndjson"):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            finished = event.get("ScenarioFinished")
            if not isinstance(finished, dict):
                continue
            label = str(finished.get("label") or finished.get("recorder", {}).get("label", "?"))
            cases = finished.get("recorder", {}).get("cases", {})
            counts[label] += len(cases)
    return counts


def test_fuzz_every_operation_against_the_document(
    server: Proc, tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    start = time.monotonic()
    code, output, report = run_schemathesis(server.root_url + "/openapi.json", tmp_path)
    seconds = time.monotonic() - start
    cases = report.get("test_cases", {})
    per_operation = cases_per_operation(tmp_path)
    figures = {
        "mode": "long" if LONG else "ci",
        "seconds": round(seconds, 1),
        "cases": cases.get("generated"),
        "cases_with_failures": cases.get("with_failures"),
        "unique_failures": cases.get("unique_failures"),
        "errors": report.get("errors"),
        "per_operation": dict(sorted(per_operation.items())),
        "phases": {k: v.get("status") for k, v in report.get("phases", {}).items()},
    }
    print("\nschemathesis:", json.dumps(figures, indent=1))
    record_property("fuzz_cases", cases.get("generated"))
    record_property("fuzz_seconds", figures["seconds"])
    record_property("fuzz_failures", cases.get("unique_failures"))
    assert report, f"no report from schemathesis (exit {code}):\n{output[-8000:]}"
    tested = report["operations"]
    assert tested["tested"] == tested["total"] == len(per_operation), tested
    assert code == 0 and not report["failures"] and not report["errors"], output[-12000:]
