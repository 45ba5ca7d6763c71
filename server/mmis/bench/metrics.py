"""The figures of one ``mmis bench serve`` run, defined as ``vllm bench serve`` defines them.

Over the completed requests (``success``) of a run of ``duration`` seconds:
- ``ttft``: each request's time to its first generated chunk.
- ``tpot`` (time per output token, the first excluded): ``(latency - ttft) / (output_tokens -
  1)`` of each request with more than one output token; a request of one token has none (and
  counts as 0 for goodput).
- ``itl``: every gap between two successive generated chunks of every request, pooled.
- ``e2el``: each request's whole latency.
- ``request_throughput`` = completed / duration; ``output_throughput`` = output tokens of the
  completed requests / duration; ``total_token_throughput`` adds their prompt tokens.
- ``request_goodput`` = completed requests that meet every SLO given (``--goodput ttft:MS
  tpot:MS e2el:MS``, each ``metric <= MS``) / duration.
Percentiles interpolate linearly between the closest ranks (``numpy.percentile``'s default);
of an empty list every statistic is 0. Times in the results are milliseconds; key names are
vLLM's (``mean_ttft_ms``, ``median_ttft_ms``, ``std_ttft_ms``, ``p99_ttft_ms``, ``p99.9_...``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from mmis.bench.client import RequestOutput

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


class MetricsError(ValueError):
    """A metric, percentile or SLO argument that cannot be used (the message names it)."""


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linear between ranks; 0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _std(values: Sequence[float]) -> float:
    """Population standard deviation (``numpy.std``'s default)."""
    if not values:
        return 0.0
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def percentile_name(q: float) -> str:
    """``99`` -> ``"99"``, ``99.9`` -> ``"99.9"`` (as vLLM names its keys)."""
    return str(int(q)) if q == int(q) else str(q)


def request_tpot(out: RequestOutput) -> float | None:
    """The request's time per output token after the first, or None with one token or fewer."""
    if out.output_tokens <= 1:
        return None
    return (out.latency - out.ttft) / (out.output_tokens - 1)


def parse_percentile_metrics(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in METRICS]
    if unknown or not names:
        raise MetricsError(
            f"--percentile-metrics {text!r}: choose from {','.join(METRICS)} (comma-separated)"
        )
    return names


def parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 < p < 100 for p in values):
        raise MetricsError(
            f"--metric-percentiles {text!r}: comma-separated numbers between 0 and 100, "
            "e.g. 50,90,99"
        )
    return values


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """``["ttft:300", "tpot:50"]`` -> ``{"ttft": 300.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        name, _, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if name not in GOODPUT_METRICS or ms < 0:
            raise MetricsError(
                f"--goodput {item!r}: give METRIC:MS with METRIC one of "
                f"{', '.join(GOODPUT_METRICS)} and MS a non-negative number, e.g. ttft:300"
            )
        slos[name] = ms
    return slos


def meets_slos(out: RequestOutput, slos: dict[str, float]) -> bool:
    """Whether a completed request meets every SLO (milliseconds; ``metric <= SLO``)."""
    values = {"ttft": out.ttft, "tpot": request_tpot(out) or 0.0, "e2el": out.latency}
    return all(values[name] * 1000 <= ms for name, ms in slos.items())


def error_key(out: RequestOutput) -> str:
    """The bucket a failed request is counted in: its HTTP status when that was not 200;
    ``timeout`` past the request's bound (or a transport timeout); ``broken_answer`` when a
    200 answer broke off or carried no generated text; ``error`` when no answer came."""
    if out.status is not None and out.status != 200:
        return str(out.status)
    if out.error.startswith("timeout"):
        return "timeout"
    return "broken_answer" if out.status == 200 else "error"


def calculate_metrics(
    outputs: Sequence[RequestOutput],
    duration: float,
    *,
    prompt_lens: Sequence[int] | None = None,
    percentile_metrics: Sequence[str] = METRICS,
    percentiles: Sequence[float] = (50, 90, 99),
    goodput: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The run's figures (see the module docstring), keyed as vLLM keys them.

    ``prompt_lens[i]`` is request ``i``'s prompt length when the server's usage did not give
    it. ``errors_by_status`` counts the failed requests by :func:`error_key`.
    """
    done = [o for o in outputs if o.success]
    input_lens = [
        o.prompt_tokens
        if o.prompt_tokens is not None
        else (prompt_lens[i] if prompt_lens is not None else 0)
        for i, o in enumerate(outputs)
    ]
    series: dict[str, list[float]] = {
        "ttft": [o.ttft for o in done],
        "tpot": [t for t in (request_tpot(o) for o in done) if t is not None],
        "itl": [gap for o in done for gap in o.itl],
        "e2el": [o.latency for o in done],
    }
    total_output = sum(o.output_tokens for o in done)
    total_input = sum(n for n, o in zip(input_lens, outputs, strict=True) if o.success)
    per_s = 1.0 / duration if duration > 0 else 0.0
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) * per_s,
        "request_goodput": (
            sum(1 for o in done if meets_slos(o, goodput)) * per_s if goodput else None
        ),
        "output_throughput": total_output * per_s,
        "total_token_throughput": (total_input + total_output) * per_s,
        "output_tokens_from_usage": all(o.tokens_from_usage for o in done) if done else False,
        "errors_by_status": dict(Counter(error_key(o) for o in outputs if not o.success)),
    }
    for name in percentile_metrics:
        ms = [v * 1000 for v in series[name]]
        result[f"mean_{name}_ms"] = _mean(ms)
        result[f"median_{name}_ms"] = percentile(ms, 50)
        result[f"std_{name}_ms"] = _std(ms)
        for q in percentiles:
            result[f"p{percentile_name(q)}_{name}_ms"] = percentile(ms, q)
    return result
