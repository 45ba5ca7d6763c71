"""``mmis serve`` under load, without and with drift: correctness first, then latency.

    .venv/bin/python benchmarks/bench_serve_load.py [--requests 500] [--concurrency 16]
        [--images 32] [--max-tokens 8] [--fault-evict-rate 0.3] [--timeout 120] [--rounds 5]
        [--threads 1] [--model M] [--against TREE]

``--against TREE`` compares two source trees instead, both with the knob off: the baseline
server runs the code of another checkout (``git worktree add TREE <commit>``; its
``server/`` first on ``PYTHONPATH``), the other this checkout's; the ratios are this tree's
over that one's, and the outputs must be identical.

One run starts ``mmis serve`` twice on the same model: the baseline (fault knob off) and one
with ``--fault-evict-rate`` (the operator-only knob: P1 evicts that fraction of cached items
on purpose, so P0's shadow hits turn into drift misses that the retry heals). Both get the
same ``--requests`` chat requests (greedy, fixed ``--max-tokens``) at ``--concurrency``,
request i carrying image i mod ``--images`` (distinct 64x64 images), after a small warm-up on
an extra image. The list is sent in ``--rounds`` chunks, alternating between the servers (the
order flips each round), so a burst of unrelated load on a shared machine hits both alike.
``--threads`` sets ``OMP_NUM_THREADS`` of both (default 1; 0 leaves torch's default, which
oversubscribes a crowded machine).

Checks (exit status 1 if any fails): zero non-2xx, zero hangs (per-request timeout), every
image gets one and the same completion in both runs. Reported: drift misses, retries by
outcome, invalidations and shadow hits (from ``/metrics``, taken as after - before), p50/p99
latency and requests/s of each run and their ratios (drift run / baseline). The last line is
a one-line summary to paste.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from serve_client import LoadResult, ServerProcess, chat_body, image_data_url, run_load


def _counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if "_total" in k}


# P0's counters on /metrics (the telemetry catalog's names)
DRIFT_MISSES = "mmis_drift_misses_total"
RETRIES = "mmis_mm_retries_total"  # {endpoint, outcome}
INVALIDATIONS = "mmis_shadow_invalidations_total"
SHADOW_HITS = "mmis_shadow_hits_total"
RETRY_OUTCOMES = ("success", "failed", "error")


def _sum(delta: dict[str, float], series: str, label: str = "") -> int:
    return int(
        sum(
            v
            for k, v in delta.items()
            if (k == series or k.startswith(series + "{")) and label in k
        )
    )


def _start(
    name: str,
    args: argparse.Namespace,
    extra: list[str],
    log_dir: Path,
    tree: Path | None = None,
) -> ServerProcess:
    serve_args = ["--max-num-seqs", str(max(args.concurrency, 16)), "--seed", "0", *extra]
    if args.model:
        serve_args += ["--model", args.model, "--served-model-name", "bench"]
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    if tree is not None:  # another checkout's code, this venv's dependencies
        env["PYTHONPATH"] = str(tree / "server")
    return ServerProcess.mmis_serve(name, serve_args, log_dir, env)


def _measure(
    servers: dict[str, ServerProcess], args: argparse.Namespace
) -> dict[str, tuple[LoadResult, dict[str, float]]]:
    """The same request list to every server, in interleaved chunks (order alternating)."""
    model = "bench" if args.model else "mmis-tiny"
    url = {name: server.root_url + "/v1/chat/completions" for name, server in servers.items()}
    warm = [("warm", chat_body(model, image_data_url(10_000), args.max_tokens))] * 4
    images = [image_data_url(seed) for seed in range(args.images)]
    requests = [
        (f"image-{i % args.images}", chat_body(model, images[i % args.images], args.max_tokens))
        for i in range(args.requests)
    ]
    chunk = -(-len(requests) // args.rounds)
    before = {}
    for name, server in servers.items():
        asyncio.run(run_load(url[name], warm, min(4, args.concurrency), args.timeout))
        before[name] = server.metrics()
    results: dict[str, LoadResult] = {}
    order = list(servers)
    for round_, start in enumerate(range(0, len(requests), chunk)):
        for name in order if round_ % 2 == 0 else order[::-1]:
            part = requests[start : start + chunk]
            result = asyncio.run(run_load(url[name], part, args.concurrency, args.timeout))
            if name in results:
                results[name].merge(result)
            else:
                results[name] = result
    return {
        name: (results[name], _counter_delta(before[name], server.metrics()))
        for name, server in servers.items()
    }


def _describe(name: str, result: LoadResult, delta: dict[str, float]) -> str:
    retries = {outcome: _sum(delta, RETRIES, f'outcome="{outcome}"') for outcome in RETRY_OUTCOMES}
    return (
        f"{name:>9}: {result.ok}/{len(result.latencies_s) + result.hangs} ok, "
        f"non-2xx {sum(n for c, n in result.statuses.items() if not 200 <= c < 300)}, "
        f"hangs {result.hangs}, transport errors {sum(result.errors.values())}; "
        f"{result.requests_per_s:.1f} req/s, p50 {result.percentile_ms(50):.0f} ms, "
        f"p99 {result.percentile_ms(99):.0f} ms; drift misses "
        f"{_sum(delta, DRIFT_MISSES)}, retries {sum(retries.values())} {retries}, "
        f"invalidations {_sum(delta, INVALIDATIONS)}, "
        f"shadow hits {_sum(delta, SHADOW_HITS)}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--fault-evict-rate", type=float, default=0.3)
    parser.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved chunks per server")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads (0: default)")
    parser.add_argument("--model", default=None, help="model dir (default: built-in mmis-tiny)")
    parser.add_argument(
        "--against", type=Path, default=None, help="another checkout: compare trees, knob off"
    )
    args = parser.parse_args()

    servers: dict[str, ServerProcess] = {}
    startup: dict[str, float] = {}
    knob = ["--fault-evict-rate", str(args.fault_evict_rate)]
    plan: list[tuple[str, list[str], Path | None]] = [("baseline", [], None), ("drift", knob, None)]
    if args.against is not None:
        plan = [("baseline", [], args.against.resolve()), ("drift", [], None)]
    with tempfile.TemporaryDirectory(prefix="bench-serve-load-") as tmp:
        try:
            for name, extra, tree in plan:
                servers[name] = _start(name, args, extra, Path(tmp), tree)
                startup[name] = servers[name].wait_http("/ready")
            measured = _measure(servers, args)
        finally:
            for name, server in servers.items():
                code = server.stop()
                if code != 0:
                    print(
                        f"warning: {name} exited with {code}\n{server.log_tail()}", file=sys.stderr
                    )
    (base, base_delta), (drift, drift_delta) = measured["baseline"], measured["drift"]
    print(f"startup to /ready: baseline {startup['baseline']:.1f}s, drift {startup['drift']:.1f}s")
    if args.against is None:
        print(_describe("baseline", base, base_delta))
        print(_describe(f"drift {args.fault_evict_rate}", drift, drift_delta))
    else:
        print(_describe("that tree", base, base_delta))
        print(_describe("this tree", drift, drift_delta))

    problems = []
    for name, result in (("baseline", base), ("drift", drift)):
        if result.failed:
            problems.append(f"{name}: {result.failed} requests without a 2xx answer")
        unstable = [k for k, outs in result.outputs.items() if len(outs) != 1]
        if unstable:
            problems.append(f"{name}: images with more than one output: {unstable}")
    differ = [k for k in base.outputs if base.outputs[k] != drift.outputs.get(k)]
    if differ:
        problems.append(f"outputs differ between the runs for {len(differ)} images: {differ[:5]}")
    if args.against is None and not _sum(drift_delta, DRIFT_MISSES):
        problems.append("the drift run saw no drift miss: the fault knob did not bite")
    if args.against is not None:
        print(f"(A/B of trees, knob off: baseline = {args.against}, then = this checkout)")
    for problem in problems:
        print("FAIL:", problem)

    p50 = drift.percentile_ms(50) / max(base.percentile_ms(50), 1e-9)
    p99 = drift.percentile_ms(99) / max(base.percentile_ms(99), 1e-9)
    rps = drift.requests_per_s / max(base.requests_per_s, 1e-9)
    print(
        f"bench_serve_load: {args.requests} req x2 at c={args.concurrency}, {args.images} images, "
        f"{args.max_tokens} tok; {'OK' if not problems else 'FAIL'} (non-2xx "
        f"{base.failed}+{drift.failed}, outputs identical: {not differ}); "
        f"drift misses {_sum(drift_delta, DRIFT_MISSES)}, "
        f"retries {_sum(drift_delta, RETRIES)} "
        f"(baseline {_sum(base_delta, DRIFT_MISSES)}/{_sum(base_delta, RETRIES)}); "
        f"p50 {base.percentile_ms(50):.0f}->{drift.percentile_ms(50):.0f} ms ({p50:.2f}x), "
        f"p99 {base.percentile_ms(99):.0f}->{drift.percentile_ms(99):.0f} ms ({p99:.2f}x), "
        f"req/s {base.requests_per_s:.1f}->{drift.requests_per_s:.1f} ({rps:.2f}x)"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
