"""The figures of ``mmis bench serve`` (``mmis.bench.metrics``), on hand-built measurements:
percentiles as numpy computes them, TPOT without the first token (vLLM's definition), ITL
pooled over requests, goodput against SLOs, failures counted by status."""

from __future__ import annotations

import numpy as np
import pytest

from mmis.bench.client import RequestOutput
from mmis.bench.metrics import (
    MetricsError,
    calculate_metrics,
    error_key,
    parse_goodput,
    parse_percentiles,
    percentile,
    request_tpot,
)


def done(ttft: float, latency: float, tokens: int, itl: list[float] | None = None) -> RequestOutput:
    return RequestOutput(
        success=True, status=200, ttft=ttft, latency=latency, output_tokens=tokens, itl=itl or []
    )


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 99.9, 100])
def test_percentile_is_numpys_linear(q: float) -> None:
    values = [float(v) for v in np.random.default_rng(3).exponential(10.0, 37)]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], q) == 0.0


def test_tpot_excludes_the_first_token() -> None:
    # 0.1 s to the first token, then 4 more tokens in 0.4 s: 0.1 s each, not 0.5 / 5
    assert request_tpot(done(ttft=0.1, latency=0.5, tokens=5)) == pytest.approx(0.1)
    assert request_tpot(done(ttft=0.1, latency=0.5, tokens=1)) is None


def test_calculate_metrics_vllm_keys_and_values() -> None:
    outputs = [
        done(0.1, 0.5, 5, [0.1, 0.1, 0.2]),
        done(0.3, 0.9, 4, [0.2, 0.4]),
        done(0.2, 0.2, 1),  # one token: no TPOT
        RequestOutput(status=404, error="HTTP 404: no such model"),
        RequestOutput(status=None, error="timeout: no complete answer within 1 s"),
        RequestOutput(status=None, error="ConnectError: refused", exception="ConnectError"),
        RequestOutput(status=200, error="the stream carried no generated text"),
    ]
    m = calculate_metrics(
        outputs,
        2.0,
        prompt_lens=[10] * 7,
        percentile_metrics=["ttft", "tpot", "itl", "e2el"],
        percentiles=[50, 99],
    )
    assert (m["completed"], m["failed"]) == (3, 4)
    assert m["errors_by_status"] == {"404": 1, "timeout": 1, "error": 1, "broken_answer": 1}
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["total_output_tokens"] == 10 and m["output_throughput"] == pytest.approx(5.0)
    assert m["total_input_tokens"] == 30
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    # TPOT of the two requests with more than one token: 100 ms and 200 ms
    assert m["mean_tpot_ms"] == pytest.approx(150.0)
    # ITL pooled over requests: 100, 100, 200, 200, 400
    assert m["mean_itl_ms"] == pytest.approx(200.0)
    assert m["p99_itl_ms"] == pytest.approx(float(np.percentile([100, 100, 200, 200, 400], 99)))
    assert m["std_e2el_ms"] == pytest.approx(float(np.std([500, 900, 200])))
    assert m["request_goodput"] is None
    assert "p90_ttft_ms" not in m


def test_goodput_counts_requests_meeting_every_slo() -> None:
    outputs = [
        done(0.1, 0.5, 5),  # ttft 100, tpot 100
        done(0.3, 0.9, 4),  # ttft 300: misses ttft:250
        done(0.2, 1.0, 5),  # tpot 200: misses tpot:150
        done(0.2, 0.2, 1),  # one token: tpot counts as 0
    ]
    slos = parse_goodput(["ttft:250", "tpot:150"])
    m = calculate_metrics(outputs, 2.0, goodput=slos, percentile_metrics=["ttft"])
    assert m["request_goodput"] == pytest.approx(2 / 2.0)


@pytest.mark.parametrize("bad", ["ttft", "latency:5", "ttft:-1", "tpot:x"])
def test_bad_goodput_names_the_option(bad: str) -> None:
    with pytest.raises(MetricsError, match="--goodput"):
        parse_goodput([bad])


def test_bad_percentiles_name_the_option() -> None:
    assert parse_percentiles("50,99.9") == [50.0, 99.9]
    with pytest.raises(MetricsError, match="--metric-percentiles"):
        parse_percentiles("0,120")


def test_error_key() -> None:
    assert error_key(RequestOutput(status=503)) == "503"
    assert error_key(RequestOutput(error="timeout: ReadTimeout: x")) == "timeout"
