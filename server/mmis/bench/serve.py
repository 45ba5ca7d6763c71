"""``mmis bench serve``: load an OpenAI-compatible endpoint (mmis, vLLM, SGLang) and measure it.

The options shared with ``vllm bench serve`` are spelled as it spells them (``--base-url``,
``--model``, ``--dataset-name``, ``--num-prompts``, ``--request-rate``, ``--burstiness``,
``--max-concurrency``, ``--save-result``, ``--result-dir``, ``--result-filename``, ``--seed``,
``--endpoint``, ``--percentile-metrics``, ``--metric-percentiles``, ``--goodput``,
``--lora-modules``, ``--lora-assignment``), so a script written for one runs the other.

With ``--lora-modules A B ...`` (names of adapters the server serves) each request's ``model``
is one of them (:func:`request_models`): ``--lora-assignment random`` (the default) draws each
from ``--seed``, ``round-robin`` cycles through them in order; the result JSON records the
names and how many requests went to each (``lora_requests``).

The run (:func:`run_requests`): every request of the workload is sent exactly once. Arrivals
follow ``--request-rate`` (``inf``: all at once; finite: a gamma process of that mean rate and
shape ``--burstiness``, 1 = Poisson, drawn from ``--seed``); ``--max-concurrency`` caps the
requests in flight (a request that arrives while the cap is reached waits for a free slot), so
``--request-rate inf --max-concurrency N`` is a closed loop of N clients. A failed request is
counted (by HTTP status, or ``timeout`` / ``error`` when no status came) and never stops the
run. The duration is from the first send to the last answer. Users asking in turn
(``--questions-per-image N``, mmis only: ``mmis.bench.datasets``): the requests of one user
(``sessions``) go one after the other, each sent once the previous answered (failed or not);
the arrivals and ``--max-concurrency`` then count users, a user holding its slot from its
first send to its last answer.

Exit status: 0 when at least one request completed (a warning line on stderr names the
failures, if any), 1 when none did (one line with the count by status and the first error),
2 for unusable arguments (one line naming the option). This module imports no torch and
nothing of the server (an import-linter contract): ``pip install mmis`` without extras runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from mmis.bench import datasets, metrics
from mmis.bench.client import RequestOutput, send

DEFAULT_ENDPOINT = "/v1/chat/completions"


class BenchError(Exception):
    """An argument or an endpoint that makes the run impossible (the message names the fix)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mmis bench serve`` (vLLM's spelling where vLLM has the option)."""
    target = parser.add_argument_group("target")
    target.add_argument(
        "--base-url",
        default=None,
        help="server root, e.g. http://127.0.0.1:8000 (default: http://HOST:PORT)",
    )
    target.add_argument("--host", default="127.0.0.1", help="server host without --base-url")
    target.add_argument("--port", type=int, default=8000, help="server port without --base-url")
    target.add_argument(
        "--endpoint",
        default=DEFAULT_ENDPOINT,
        help="API path: /v1/chat/completions, or /v1/completions for text-only prompts",
    )
    target.add_argument(
        "--model",
        default=None,
        help="model name sent in each request (default: the first of the server's /v1/models)",
    )
    target.add_argument(
        "--served-model-name",
        default=None,
        help="name sent in requests when it differs from --model (vLLM's meaning)",
    )
    target.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME",
        help="LoRA adapter names the server serves: each request's model is one of them "
        "(see --lora-assignment); default: every request names --model",
    )
    target.add_argument(
        "--lora-assignment",
        default="random",
        choices=["random", "round-robin"],
        help="how requests pick their --lora-modules name: random (drawn from --seed) or "
        "round-robin",
    )
    target.add_argument(
        "--api-key",
        default=None,
        help="bearer token sent as Authorization (default: $OPENAI_API_KEY, if set)",
    )
    target.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds one request may take, stream included, before it counts as failed",
    )

    data = parser.add_argument_group("workload")
    data.add_argument(
        "--dataset-name",
        default="random-mm",
        choices=["random-mm", "image-folder"],
        help="random-mm: generated images and prompts; image-folder: the images of --dataset-path",
    )
    data.add_argument(
        "--dataset-path",
        type=Path,
        default=None,
        help="image-folder: a folder of images, with an optional prompts.txt (one per line)",
    )
    data.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    data.add_argument("--random-mm-num-images", type=int, default=1, help="images per request")
    data.add_argument("--random-mm-width", type=int, default=512, help="image width (pixels)")
    data.add_argument("--random-mm-height", type=int, default=512, help="image height (pixels)")
    data.add_argument(
        "--random-mm-repeat-ratio",
        type=float,
        default=0.0,
        help="share of the images that repeat an earlier one (0: every image unique)",
    )
    data.add_argument(
        "--random-input-len", type=int, default=32, help="prompt words (about one token each)"
    )
    data.add_argument(
        "--random-output-len",
        type=int,
        default=128,
        help="max output tokens per request (both datasets)",
    )
    data.add_argument(
        "--questions-per-image",
        type=int,
        default=1,
        help="mmis only (vLLM's bench has no such workload): users each asking N questions "
        "about their own images (both datasets), one after the other, the next once the "
        "previous answered, the images before the text so the questions share their prefix; "
        "--num-prompts counts questions, --max-concurrency and --request-rate count users "
        "(1: each request on its own, text first, as vLLM sends them)",
    )
    data.add_argument("--seed", type=int, default=0, help="seed of the workload and the arrivals")
    data.add_argument(
        "--ignore-eos", action="store_true", help="ask for exactly the output length (vLLM's)"
    )
    data.add_argument(
        "--temperature", type=float, default=None, help="sampling temperature (default: server's)"
    )
    data.add_argument(
        "--extra-body",
        default=None,
        help="a JSON object merged into every request body, e.g. '{\"top_k\": 1}'",
    )

    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second (inf: all at once; finite: Poisson, see --burstiness)",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="shape of the gamma arrival process (1: Poisson; <1 burstier; >1 steadier)",
    )
    load.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests in flight (with --request-rate inf: a closed loop of N clients)",
    )
    load.add_argument("--disable-tqdm", action="store_true", help="no progress line on stderr")

    report = parser.add_argument_group("results")
    report.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl,e2el",
        help="comma-separated metrics given with percentiles: ttft, tpot, itl, e2el",
    )
    report.add_argument(
        "--metric-percentiles",
        default="50,90,99",
        help="comma-separated percentiles of each metric, e.g. 50,90,99,99.9",
    )
    report.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="SLOs of request_goodput, e.g. ttft:300 tpot:50 (metrics: ttft, tpot, e2el)",
    )
    report.add_argument("--save-result", action="store_true", help="write the results as JSON")
    report.add_argument(
        "--save-detailed",
        action="store_true",
        help="also save each request's generated text in the JSON",
    )
    report.add_argument("--result-dir", type=Path, default=None, help="folder of the JSON file")
    report.add_argument(
        "--result-filename",
        default=None,
        help="JSON file name (default: mmis-RATEqps-concurrencyN-MODEL-DATE.json)",
    )
    report.add_argument(
        "--plot-cdf",
        type=Path,
        default=None,
        metavar="FILE",
        help="draw the latency CDFs (TTFT, TPOT, E2E) into FILE (needs matplotlib)",
    )
    report.add_argument(
        "--compare",
        nargs=2,
        type=Path,
        default=None,
        metavar=("A.json", "B.json"),
        help="run nothing: print the table of two saved results (as `mmis bench compare`)",
    )


def build_body(
    sample: datasets.SampleRequest,
    model: str,
    endpoint: str,
    *,
    ignore_eos: bool = False,
    temperature: float | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The streamed request of one sample, usage asked for (``stream_options``)."""
    body: dict[str, Any]
    if endpoint.rstrip("/").endswith("/chat/completions"):
        text = [{"type": "text", "text": sample.prompt}]
        images = [{"type": "image_url", "image_url": {"url": url}} for url in sample.images]
        content = images + text if sample.images_first else text + images
        body = {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_completion_tokens": sample.output_len,
        }
    else:
        if sample.images:
            raise BenchError(
                f"--endpoint {endpoint} takes text only; use /v1/chat/completions for images "
                "or --random-mm-num-images 0"
            )
        body = {"model": model, "prompt": sample.prompt, "max_tokens": sample.output_len}
    body.update(stream=True, stream_options={"include_usage": True})
    if ignore_eos:
        body["ignore_eos"] = True
    if temperature is not None:
        body["temperature"] = temperature
    body.update(extra or {})
    return body


def request_models(
    n: int,
    model: str,
    lora_modules: Sequence[str] | None,
    assignment: str = "random",
    seed: int = 0,
) -> list[str]:
    """The ``model`` of each of ``n`` requests: ``model`` without ``lora_modules``; else one of
    them per request, ``random`` (drawn from ``seed``: the same seed, the same names) or
    ``round-robin`` (in the order given)."""
    if not lora_modules:
        return [model] * n
    names = list(lora_modules)
    if assignment == "round-robin":
        return [names[i % len(names)] for i in range(n)]
    rng = random.Random(seed)
    return [rng.choice(names) for _ in range(n)]


def arrival_delays(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """The wait before each of ``n`` sends: 0 at ``rate`` inf, else gamma(``burstiness``) gaps
    of mean ``1 / rate`` (the first request goes at once)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return [0.0, *(float(g) for g in gaps[: n - 1])] if n else []


class Progress:
    """A one-line counter on stderr (``\\r``-rewritten on a terminal, a line per 10% else)."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.enabled = total, enabled
        self.done = self.failed = 0
        self.start = time.perf_counter()
        self._tty = sys.stderr.isatty()
        self._shown = -1.0

    def update(self, out: RequestOutput) -> None:
        self.done += 1
        self.failed += 0 if out.success else 1
        if not self.enabled:
            return
        now = time.perf_counter()
        last = self.done == self.total
        if self._tty and (last or now - self._shown >= 0.2):
            self._shown = now
            print("\r" + self._line(now), end="\n" if last else "", file=sys.stderr, flush=True)
        elif not self._tty and (last or self.done * 10 // self.total > self._shown):
            self._shown = self.done * 10 // self.total
            print(self._line(now), file=sys.stderr, flush=True)

    def _line(self, now: float) -> str:
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        return (
            f"  {self.done}/{self.total} requests, {self.failed} failed, "
            f"{elapsed:.1f} s, {rate:.2f} req/s"
        )


async def run_requests(
    url: str,
    bodies: Sequence[dict[str, Any]],
    *,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
    headers: dict[str, str] | None = None,
    timeout: float | None = None,
    on_done: Callable[[RequestOutput], None] | None = None,
    sessions: Sequence[int | None] | None = None,
) -> tuple[list[RequestOutput], float]:
    """Send each body once to ``url`` (see the module docstring): (outputs in the bodies'
    order, duration in seconds from the first send to the last answer). ``sessions``: each
    body's user (None: on its own); one user's bodies are sent in their list order, each once
    the previous answered, under one arrival and one concurrency slot."""
    if max_concurrency is not None and max_concurrency < 1:
        raise BenchError(f"--max-concurrency must be at least 1, got {max_concurrency}")
    if request_rate <= 0 or burstiness <= 0:
        raise BenchError("--request-rate and --burstiness must be positive")
    groups: list[list[int]] = []  # the bodies each arrival sends, in order
    by_session: dict[int, list[int]] = {}
    for i, session in enumerate(sessions if sessions is not None else [None] * len(bodies)):
        if session is None:
            groups.append([i])
        elif session in by_session:
            by_session[session].append(i)
        else:
            groups.append(by_session.setdefault(session, [i]))
    delays = arrival_delays(len(groups), request_rate, burstiness, seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(
        max_connections=max_concurrency, max_keepalive_connections=max_concurrency
    )
    outputs: list[RequestOutput] = [RequestOutput() for _ in bodies]

    async def in_turn(http: httpx.AsyncClient, group: list[int]) -> None:
        for i in group:
            outputs[i] = await send(http, url, bodies[i], headers=headers, timeout=timeout)
            if on_done is not None:
                on_done(outputs[i])

    async def one(http: httpx.AsyncClient, group: list[int]) -> None:
        if gate is None:
            await in_turn(http, group)
        else:
            async with gate:
                await in_turn(http, group)

    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        start = time.perf_counter()
        tasks = []
        for group, delay in zip(groups, delays, strict=True):
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(http, group)))
        await asyncio.gather(*tasks)
        return outputs, time.perf_counter() - start


def _root(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def _headers(args: argparse.Namespace) -> dict[str, str]:
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _served_model(args: argparse.Namespace, headers: dict[str, str]) -> str:
    if args.served_model_name or args.model:
        return str(args.served_model_name or args.model)
    url = _root(args) + "/v1/models"
    try:
        response = httpx.get(url, headers=headers, timeout=30)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        raise BenchError(f"no --model given and {url} named none ({exc}); pass --model") from exc


def build_dataset(args: argparse.Namespace) -> list[datasets.SampleRequest]:
    if args.dataset_name == "image-folder":
        if args.dataset_path is None:
            raise BenchError("--dataset-name image-folder needs --dataset-path DIR")
        return datasets.image_folder(
            args.dataset_path,
            args.num_prompts,
            output_len=args.random_output_len,
            questions=args.questions_per_image,
        )
    return datasets.random_mm(
        args.num_prompts,
        num_images=args.random_mm_num_images,
        width=args.random_mm_width,
        height=args.random_mm_height,
        repeat_ratio=args.random_mm_repeat_ratio,
        input_len=args.random_input_len,
        output_len=args.random_output_len,
        seed=args.seed,
        questions=args.questions_per_image,
    )


def summary_lines(result: dict[str, Any], percentile_metrics: Sequence[str]) -> list[str]:
    """The run's figures as ``vllm bench serve`` prints them."""

    def row(name: str, value: Any) -> str:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        return f"{name:<40}{text:<10}"

    lines = [
        "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
        row("Successful requests:", result["completed"]),
        row("Failed requests:", result["failed"]),
    ]
    if result["errors_by_status"]:
        by = ", ".join(f"{k}: {v}" for k, v in sorted(result["errors_by_status"].items()))
        lines.append(row("Failures by status:", by))
    lines += [
        row("Maximum request concurrency:", result["max_concurrency"]),
        row("Benchmark duration (s):", result["duration"]),
        row("Total input tokens:", result["total_input_tokens"]),
        row("Total generated tokens:", result["total_output_tokens"]),
        row("Request throughput (req/s):", result["request_throughput"]),
    ]
    if result["request_goodput"] is not None:
        lines.append(row("Request goodput (req/s):", result["request_goodput"]))
    lines += [
        row("Output token throughput (tok/s):", result["output_throughput"]),
        row("Total Token throughput (tok/s):", result["total_token_throughput"]),
    ]
    for name in percentile_metrics:
        lines.append("{s:{c}^{n}}".format(s=metrics.METRIC_TITLES[name], n=50, c="-"))
        upper = name.upper()
        lines.append(row(f"Mean {upper} (ms):", result[f"mean_{name}_ms"]))
        lines.append(row(f"Median {upper} (ms):", result[f"median_{name}_ms"]))
        for key, value in result.items():
            if key.startswith("p") and key.endswith(f"_{name}_ms") and key != f"p50_{name}_ms":
                lines.append(row(f"P{key[1:].split('_')[0]} {upper} (ms):", value))
    lines.append("=" * 50)
    return lines


def result_filename(args: argparse.Namespace, model: str, now: datetime) -> str:
    if args.result_filename:
        return str(args.result_filename)
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    return (
        f"mmis-{rate}qps-concurrency{args.max_concurrency}-{model.split('/')[-1]}-"
        f"{now:%Y%m%d-%H%M%S}.json"
    )


def plot_cdf(path: Path, outputs: Sequence[RequestOutput]) -> None:
    """The CDFs of TTFT, TPOT and end-to-end latency of the completed requests into ``path``."""
    import matplotlib  # optional: checked before the run

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [o for o in outputs if o.success]
    series = {
        "TTFT": [o.ttft * 1000 for o in done],
        "TPOT": [t * 1000 for t in (metrics.request_tpot(o) for o in done) if t is not None],
        "E2E latency": [o.latency * 1000 for o in done],
    }
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (name, values) in zip(axes, series.items(), strict=True):
        values = sorted(values)
        ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """``mmis bench serve``: the exit status (see the module docstring)."""
    if args.compare:
        from mmis.bench.compare import print_compare

        return print_compare(args.compare[0], args.compare[1])
    try:
        return _run(args)
    except (BenchError, datasets.DatasetError, metrics.MetricsError) as exc:
        print(f"mmis bench serve: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    percentile_metrics = metrics.parse_percentile_metrics(args.percentile_metrics)
    percentiles = metrics.parse_percentiles(args.metric_percentiles)
    goodput = metrics.parse_goodput(args.goodput) if args.goodput else None
    if args.plot_cdf is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise BenchError("--plot-cdf needs matplotlib: pip install matplotlib") from exc
    try:
        extra = json.loads(args.extra_body) if args.extra_body else None
    except ValueError as exc:
        raise BenchError(f"--extra-body is not JSON: {exc}") from exc
    if extra is not None and not isinstance(extra, dict):
        raise BenchError("--extra-body must be a JSON object")
    headers = _headers(args)
    samples = build_dataset(args)
    model = _served_model(args, headers)
    url = _root(args) + "/" + args.endpoint.lstrip("/")
    names = request_models(len(samples), model, args.lora_modules, args.lora_assignment, args.seed)
    bodies = [
        build_body(
            s,
            name,
            args.endpoint,
            ignore_eos=args.ignore_eos,
            temperature=args.temperature,
            extra=extra,
        )
        for s, name in zip(samples, names, strict=True)
    ]
    print(
        f"mmis bench serve: {len(bodies)} requests to {url} ({args.dataset_name}), "
        f"request rate {args.request_rate:g}, burstiness {args.burstiness:g}, "
        f"max concurrency {args.max_concurrency}"
        + (
            f", adapters {' '.join(args.lora_modules)} ({args.lora_assignment})"
            if args.lora_modules
            else ""
        ),
        file=sys.stderr,
    )
    progress = Progress(len(bodies), enabled=not args.disable_tqdm)
    now = datetime.now()
    outputs, duration = asyncio.run(
        run_requests(
            url,
            bodies,
            max_concurrency=args.max_concurrency,
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            seed=args.seed,
            headers=headers,
            timeout=args.request_timeout,
            on_done=progress.update,
            sessions=[s.session for s in samples],
        )
    )
    figures = metrics.calculate_metrics(
        outputs,
        duration,
        prompt_lens=[s.prompt_len for s in samples],
        percentile_metrics=percentile_metrics,
        percentiles=percentiles,
        goodput=goodput,
    )
    result: dict[str, Any] = {
        "date": now.strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if "chat" in args.endpoint else "openai",
        "base_url": _root(args),
        "endpoint": args.endpoint,
        "model_id": model,
        "dataset_name": args.dataset_name,
        "num_prompts": len(bodies),
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "lora_modules": list(args.lora_modules) if args.lora_modules else None,
        "lora_assignment": args.lora_assignment if args.lora_modules else None,
        "lora_requests": (
            {n: names.count(n) for n in args.lora_modules} if args.lora_modules else None
        ),
        "goodput_slos_ms": goodput,
        **figures,
        "input_lens": [
            o.prompt_tokens if o.prompt_tokens is not None else s.prompt_len
            for o, s in zip(outputs, samples, strict=True)
        ],
        "output_lens": [o.output_tokens for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "errors": [o.error for o in outputs],
    }
    if args.save_detailed:
        result["generated_texts"] = [o.generated_text for o in outputs]
    print("\n".join(summary_lines(result, percentile_metrics)))
    if args.save_result or args.save_detailed:
        directory = args.result_dir or Path(".")
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / result_filename(args, model, now)
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"mmis bench serve: results in {path}", file=sys.stderr)
    if args.plot_cdf is not None and figures["completed"]:
        plot_cdf(args.plot_cdf, outputs)
    return _verdict(figures, outputs)


def _verdict(figures: dict[str, Any], outputs: Sequence[RequestOutput]) -> int:
    if not figures["failed"]:
        return 0
    by = ", ".join(f"{k}: {v}" for k, v in sorted(figures["errors_by_status"].items()))
    first = next(o.error for o in outputs if not o.success)
    if figures["completed"]:
        print(
            f"mmis bench serve: warning: {figures['failed']} of {len(outputs)} requests failed "
            f"({by}); first error: {first}",
            file=sys.stderr,
        )
        return 0
    print(
        f"mmis bench serve: all {len(outputs)} requests failed ({by}); first error: {first}",
        file=sys.stderr,
    )
    return 1
