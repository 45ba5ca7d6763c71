"""``mmis serve`` vs ``transformers serve`` on the same tiny model and workload, one run.

    .venv/bin/python benchmarks/bench_vs_transformers.py [--requests 128] [--concurrency 16]
        [--max-tokens 16] [--images 0] [--rounds 3] [--threads 1] [--model DIR]
        [--only mmis tf tf-cb] [--check]

Servers, all started first (so each is measured with the others idle beside it):
- ``tf``: ``transformers serve DIR`` (``HF_HUB_OFFLINE=1``; the model is named by its path);
- ``tf-cb``: the same with ``--continuous-batching`` (transformers 5.24 logs that LLaVA does
  not support it and falls back to sequential generation);
- ``mmis``: ``mmis serve --model DIR`` (served under the same name).

Each is warmed up, then measured in ``--rounds`` interleaved rounds (the server order rotates
each round), so a burst of unrelated load on a shared machine hits every server alike; the
figures aggregate all rounds and the per-round requests/s spread is shown.

Workload, identical for all: ``--requests`` chat requests per round, each with one 64x64 PNG
image and a short text, greedy, ``--max-tokens`` output tokens, ``--concurrency`` in flight.
By default every request carries its own image, new in every round (``--images 0``: no
multimodal cache can help); with ``--images K`` the requests cycle over K images. DIR
defaults to the built-in tiny LLaVA. ``--threads N`` (default 1; 0 leaves each server's default)
gives every server, mmis's engine child included, the same ``OMP_NUM_THREADS``: on a crowded
machine torch's default intra-op pool oversubscribes the cores and every figure collapses.

Reported per server: requests/s, output tokens/s, p50/p99 latency, and how many completions
equal mmis's (greedy decoding on the same weights: a fast but wrong server shows up here).
Ratios are mmis over each transformers variant (target: at least 2x the requests/s of the
better one); ``--check`` exits 1 below it, or if any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

from serve_client import (
    MMIS,
    LoadResult,
    ServerProcess,
    chat_body,
    free_port,
    image_data_url,
    run_load,
)

TARGET = 2.0
WARMUP_SEED = 1_000_000


def _start(kind: str, model: str, log_dir: Path, threads: int) -> ServerProcess:
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if threads:  # the same for every server (and mmis's engine child)
        env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if kind == "mmis":
        return ServerProcess.mmis_serve(
            kind, ["--model", model, "--served-model-name", model], log_dir, env
        )
    port = free_port()
    cmd = [str(Path(MMIS).parent / "transformers"), "serve", model]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    if kind == "tf-cb":
        cmd.append("--continuous-batching")
    proc = ServerProcess(kind, cmd, log_dir, env)
    proc.root_url = f"http://127.0.0.1:{port}"
    return proc


def _workload(args: argparse.Namespace, round_: int) -> list[tuple[str, dict[str, Any]]]:
    cycle = args.images or args.requests
    base = 0 if args.images else round_ * args.requests
    return [
        (
            f"image-{base + i % cycle}",
            chat_body(args.model, image_data_url(base + i % cycle), args.max_tokens),
        )
        for i in range(args.requests)
    ]


def _measure(
    servers: dict[str, ServerProcess], args: argparse.Namespace
) -> dict[str, list[LoadResult]]:
    warm = [
        ("warm", chat_body(args.model, image_data_url(WARMUP_SEED + i), args.max_tokens))
        for i in range(args.concurrency)
    ]
    url = {kind: server.root_url + "/v1/chat/completions" for kind, server in servers.items()}
    for kind in servers:
        asyncio.run(run_load(url[kind], warm, args.concurrency, args.timeout))
    rounds: dict[str, list[LoadResult]] = {kind: [] for kind in servers}
    order = list(servers)
    for round_ in range(args.rounds):
        requests = _workload(args, round_)
        for kind in order[round_ % len(order) :] + order[: round_ % len(order)]:
            result = asyncio.run(run_load(url[kind], requests, args.concurrency, args.timeout))
            rounds[kind].append(result)
            print(f"round {round_ + 1} {kind:>6}: {result.requests_per_s:6.1f} req/s", flush=True)
    return rounds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=128, help="per round and server")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--images", type=int, default=0, help="distinct images (0: one each)")
    parser.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    parser.add_argument("--model", default=None, help="model directory (default: tiny LLaVA)")
    parser.add_argument("--only", nargs="+", choices=["tf", "tf-cb", "mmis"], default=None)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OMP/MKL threads of every server (0: each server's default)",
    )
    parser.add_argument("--check", action="store_true", help=f"exit 1 below {TARGET}x")
    args = parser.parse_args()
    if args.model is None:
        from mmis.tiny_models.tiny_model import tiny_model_dir

        args.model = str(tiny_model_dir())
    kinds = args.only or ["tf", "tf-cb", "mmis"]

    servers: dict[str, ServerProcess] = {}
    with tempfile.TemporaryDirectory(prefix="bench-vs-tf-") as tmp:
        try:
            for kind in kinds:
                servers[kind] = _start(kind, args.model, Path(tmp), args.threads)
                up = servers[kind].wait_http("/ready" if kind == "mmis" else "/health")
                print(f"{kind:>6}: up in {up:.1f}s", flush=True)
            rounds = _measure(servers, args)
        finally:
            for server in servers.values():
                server.stop()
    results: dict[str, LoadResult] = {}
    spread: dict[str, str] = {}
    for kind, per_round in rounds.items():
        rates = [r.requests_per_s for r in per_round]
        spread[kind] = f"{min(rates):.1f}-{max(rates):.1f}"
        results[kind] = per_round[0]
        for later in per_round[1:]:
            results[kind].merge(later)

    reference = results.get("mmis")
    failed = False
    print(
        f"model {args.model}; {args.rounds}x{args.requests} requests, c={args.concurrency}, "
        f"{args.max_tokens} tokens, images {'one each' if not args.images else args.images}"
    )
    for kind, res in results.items():
        failed = failed or res.failed > 0
        same = ""
        if reference is not None and kind != "mmis":
            equal = sum(1 for k, outs in res.outputs.items() if outs == reference.outputs.get(k))
            same = f", completions equal to mmis {equal}/{len(res.outputs)}"
        print(
            f"{kind:>6}: {res.ok}/{args.rounds * args.requests} ok, "
            f"{res.requests_per_s:6.1f} req/s (rounds {spread[kind]}), "
            f"{res.completion_tokens / res.wall_s:7.1f} out tok/s, "
            f"p50 {res.percentile_ms(50):6.0f} ms, p99 {res.percentile_ms(99):6.0f} ms{same}"
        )
    if reference is None:
        return 1 if failed else 0
    ratios = {
        kind: reference.requests_per_s / max(res.requests_per_s, 1e-9)
        for kind, res in results.items()
        if kind != "mmis"
    }
    parts = [
        f"{kind} {res.requests_per_s:.1f} req/s p50 {res.percentile_ms(50):.0f} ms"
        for kind, res in results.items()
    ]
    print(
        "bench_vs_transformers: "
        + "; ".join(parts)
        + "; mmis/"
        + ", mmis/".join(f"{k} {r:.2f}x" for k, r in ratios.items())
        + f" (target >= {TARGET}x)"
    )
    below = bool(ratios) and min(ratios.values()) < TARGET
    return 1 if failed or (args.check and below) else 0


if __name__ == "__main__":
    sys.exit(main())
