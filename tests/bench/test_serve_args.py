"""``mmis bench serve`` before any request: the arrival process (``--request-rate``,
``--burstiness``, ``--seed``), the request body, and unusable arguments refused with exit 2
and one line naming the option."""

from __future__ import annotations

import argparse
import importlib.util
import statistics

import pytest

from mmis.bench.datasets import SampleRequest
from mmis.bench.serve import arrival_delays, build_body, request_models
from mmis.entrypoints import bench


def test_arrivals_inf_at_once_finite_poisson_seeded() -> None:
    assert arrival_delays(4, float("inf"), 1.0, 0) == [0.0] * 4
    gaps = arrival_delays(4000, 20.0, 1.0, 7)
    assert gaps[0] == 0.0 and gaps == arrival_delays(4000, 20.0, 1.0, 7)
    assert statistics.mean(gaps[1:]) == pytest.approx(1 / 20, rel=0.05)
    # Poisson: exponential gaps, standard deviation = mean; burstiness 4: half of it
    assert statistics.pstdev(gaps[1:]) == pytest.approx(1 / 20, rel=0.08)
    steady = arrival_delays(4000, 20.0, 4.0, 7)
    assert statistics.pstdev(steady[1:]) == pytest.approx(1 / 20 / 2, rel=0.08)


def test_body_streams_with_usage_and_images_after_the_text() -> None:
    sample = SampleRequest("hi there", 2, ("data:image/jpeg;base64,AA==",), 5)
    body = build_body(sample, "m", "/v1/chat/completions", ignore_eos=True, extra={"top_k": 1})
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_completion_tokens"] == 5 and body["ignore_eos"] and body["top_k"] == 1
    content = body["messages"][0]["content"]
    assert [part["type"] for part in content] == ["text", "image_url"]


def test_lora_modules_pick_each_requests_model_seeded_or_in_turn() -> None:
    assert request_models(3, "base", None) == ["base"] * 3
    assert request_models(5, "base", ["a", "b", "c"], "round-robin") == ["a", "b", "c", "a", "b"]
    drawn = request_models(200, "base", ["a", "b", "c", "d"], "random", 7)
    assert drawn == request_models(200, "base", ["a", "b", "c", "d"], "random", 7)
    assert drawn != request_models(200, "base", ["a", "b", "c", "d"], "random", 8)
    assert all(25 <= drawn.count(name) <= 75 for name in "abcd")  # each about 50 of 200


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mmis bench")
    bench.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--goodput", "ttft"], "--goodput"),
        (["--percentile-metrics", "ttft,latency"], "--percentile-metrics"),
        (["--dataset-name", "image-folder"], "--dataset-path"),
        (["--random-mm-repeat-ratio", "2"], "--random-mm-repeat-ratio"),
        (["--extra-body", "[1]"], "--extra-body"),
        (["--max-concurrency", "0"], "--max-concurrency"),
    ],
)
def test_unusable_arguments_exit_2_naming_the_option(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # port 9 (discard): nothing must be sent before the arguments are checked
    args = parse("serve", "--port", "9", "--model", "m", "--num-prompts", "2", *argv)
    assert bench.run(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("mmis bench serve: ") and named in err[-1]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is not None, reason="has matplotlib")
def test_plot_cdf_without_matplotlib_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.run(parse("serve", "--port", "9", "--plot-cdf", "cdf.png")) == 2
    assert "--plot-cdf needs matplotlib" in capsys.readouterr().err
