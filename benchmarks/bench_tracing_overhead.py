"""Throughput of ``mmis serve`` with tracing on (100% sampled, into a real Jaeger) vs off.

    .venv/bin/python benchmarks/bench_tracing_overhead.py [--requests 3000] [--concurrency 16]
        [--images 32] [--max-tokens 8] [--warmup 200] [--rounds 6] [--timeout 120] [--threads 1]

One run starts a Jaeger v2 all-in-one on loopback (``tests/tools.py``; build it with
``scripts/gotools jaeger``) and ``mmis serve`` twice on the built-in tiny model: the baseline
(no OTLP endpoint: tracing off, a no-op tracer) and ``traced`` (``--otlp-traces-endpoint`` to
Jaeger's OTLP/gRPC receiver, ``OTEL_TRACES_SAMPLER=parentbased_traceidratio`` with
``OTEL_TRACES_SAMPLER_ARG`` = ``--sampling``, default 1: every request traced in P0 and P1;
``--sampling 0`` isolates the cost of the instrumentation without recording or export).
Both get the same chat requests (greedy, fixed ``--max-tokens``, one image each, image i mod
``--images``) at ``--concurrency``, after ``--warmup`` requests each (enough that the batch
exporters have connected and sent their first batches: the steady state is what is measured;
480-request runs last about 1.5 s and swing by +-15% on a shared machine), in ``--rounds``
interleaved chunks
whose order flips each round, so a burst of unrelated load on a shared machine hits both
alike. ``--threads`` sets ``OMP_NUM_THREADS`` of both (default 1).

Checks (exit status 1 if any fails): every request answered 2xx in both runs, identical
completions per image, and Jaeger holds a trace of both services for every traced request
(tracing really was on). The ratio judged is the median over rounds of traced req/s / baseline
req/s of the round's two back-to-back chunks (target >= 0.95); the ratio of the totals is
printed beside it. ``--control`` runs both servers untraced: the same figures then show the
measurement's own noise.
On a crowded machine throughput swings with the neighbours' load, so the CPU seconds serve
(P0 + P1) spent per request are reported beside it: the cost tracing adds, independent of
how much CPU the machine had to give. The last line is a ``SUMMARY bench_tracing_overhead:``
line to paste.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serve_client import LoadResult, ServerProcess, chat_body, image_data_url, run_load

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tools import Jaeger, missing_tool, tools_bin

TARGET = 0.95
MODEL = "mmis-tiny"


def _measure(
    servers: dict[str, ServerProcess], args: argparse.Namespace
) -> tuple[dict[str, LoadResult], int, list[float]]:
    """The same request list to every server in interleaved chunks.

    Returns the merged results, the warm-up count and, per round, traced req/s over baseline
    req/s of the two back-to-back chunks (their median shrugs off a neighbour's burst that
    hit one chunk only)."""
    url = {name: server.root_url + "/v1/chat/completions" for name, server in servers.items()}
    warm = [("warm", chat_body(MODEL, image_data_url(10_000), args.max_tokens))] * args.warmup
    images = [image_data_url(seed) for seed in range(args.images)]
    requests = [
        (f"image-{i % args.images}", chat_body(MODEL, images[i % args.images], args.max_tokens))
        for i in range(args.requests)
    ]
    for name in servers:
        asyncio.run(run_load(url[name], warm, min(4, args.concurrency), args.timeout))
    results: dict[str, LoadResult] = {}
    order = list(servers)
    chunk = -(-len(requests) // args.rounds)
    ratios = []
    for round_, start in enumerate(range(0, len(requests), chunk)):
        rates = {}
        for name in order if round_ % 2 == 0 else order[::-1]:
            part = requests[start : start + chunk]
            result = asyncio.run(run_load(url[name], part, args.concurrency, args.timeout))
            rates[name] = result.requests_per_s
            if name in results:
                results[name].merge(result)
            else:
                results[name] = result
        ratios.append(rates["traced"] / max(rates["baseline"], 1e-9))
    return results, len(warm), ratios


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its children (serve's P0 and its P1)."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
            if parent == pid:
                children.append(int(entry.name))
    return _cpu_s(pid) + sum(_cpu_s(child) for child in children)


def _traces_with_both_services(jaeger: Jaeger, expected: int, timeout: float = 60.0) -> int:
    """How many traces in Jaeger hold spans of P0 and P1, waiting for the batch exporters."""
    deadline = time.monotonic() + timeout
    while True:
        reply = httpx.get(
            jaeger.query_url + "/api/traces",
            params={"service": "mmis-frontend", "limit": str(expected + 100), "lookback": "1h"},
            timeout=120,
        )
        reply.raise_for_status()
        joined = 0
        for trace in reply.json()["data"] or []:
            services = {p["serviceName"] for p in trace["processes"].values()}
            joined += {"mmis-frontend", "mmis-engine"} <= services
        if joined >= expected or time.monotonic() > deadline:
            return joined
        time.sleep(0.5)  # polling Jaeger while the exporters flush; not a synchronisation


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=200, help="requests per server first")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10, help="interleaved chunks per server")
    parser.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    parser.add_argument(
        "--sampling", type=float, default=1.0, help="OTEL_TRACES_SAMPLER_ARG of the traced run"
    )
    parser.add_argument("--threads", type=int, default=1, help="OMP threads (0: default)")
    parser.add_argument(
        "--control", action="store_true", help="A/A run: both servers untraced (noise floor)"
    )
    args = parser.parse_args()
    reason = missing_tool("jaeger")
    if reason is not None:
        print(f"jaeger unavailable ({reason}); run scripts/gotools jaeger", file=sys.stderr)
        return 2

    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    serve_args = ["--max-num-seqs", str(max(args.concurrency, 16)), "--seed", "0"]
    servers: dict[str, ServerProcess] = {}
    with tempfile.TemporaryDirectory(prefix="bench-tracing-") as tmp:
        jaeger = Jaeger(tools_bin() / "jaeger", Path(tmp))
        try:
            jaeger.wait_ready()
            traced_env = {**env, "OTEL_TRACES_SAMPLER_ARG": str(args.sampling)}
            # the ratio only applies to a ratio sampler (the default is parentbased_always_on)
            traced_env["OTEL_TRACES_SAMPLER"] = "parentbased_traceidratio"
            traced = ["--otlp-traces-endpoint", jaeger.otlp_grpc]
            if args.control:  # A/A: the "traced" server is a second untraced one
                traced, traced_env = [], env
            for name, extra, extra_env in (
                ("baseline", [], env),
                ("traced", traced, traced_env),
            ):
                servers[name] = ServerProcess.mmis_serve(
                    name, [*serve_args, *extra], Path(tmp), extra_env
                )
                servers[name].wait_http("/ready")
            jaeger_cpu = _cpu_s(jaeger.popen.pid)
            cpu = {name: _tree_cpu_s(server.popen.pid) for name, server in servers.items()}
            results, warm, ratios = _measure(servers, args)
            jaeger_cpu = _cpu_s(jaeger.popen.pid) - jaeger_cpu
            expected = round((args.requests + warm) * args.sampling)
            joined = _traces_with_both_services(jaeger, expected)
            # read once every span is exported (the batch exporter's CPU counts); includes
            # the warm-up; an idle server burns ~0 CPU while the other one runs
            cpu = {n: _tree_cpu_s(s.popen.pid) - cpu[n] for n, s in servers.items()}
            jaeger_total = _cpu_s(jaeger.popen.pid)
        finally:
            for name, server in servers.items():
                code = server.stop()
                if code != 0:
                    print(f"warning: {name} exited {code}\n{server.log_tail()}", file=sys.stderr)
            jaeger.stop()

    base, traced_result = results["baseline"], results["traced"]
    problems = []
    for name, result in results.items():
        if result.failed:
            problems.append(f"{name}: {result.failed} requests without a 2xx answer")
    differ = [k for k in base.outputs if base.outputs[k] != traced_result.outputs.get(k)]
    if differ:
        problems.append(f"outputs differ between the runs for {len(differ)} images")
    if args.control:
        expected = 0
    if joined < expected * 0.9 or (args.sampling == 1.0 and joined < expected):
        problems.append(f"jaeger holds {joined} P0+P1 traces, expected {expected}")
    for problem in problems:
        print("FAIL:", problem)

    cpu_ms = {name: 1000 * cpu[name] / (args.requests + warm) for name in results}
    for name, result in results.items():
        print(
            f"{name:>9}: {result.ok} ok, {result.requests_per_s:.2f} req/s, "
            f"p50 {result.percentile_ms(50):.0f} ms, p99 {result.percentile_ms(99):.0f} ms, "
            f"P0+P1 CPU {cpu_ms[name]:.2f} ms/request"
        )
    print(
        f"jaeger (same machine, {os.cpu_count()} CPUs) used {jaeger_cpu:.1f} CPU-s while the "
        f"traced server ran {traced_result.wall_s:.1f} s ({jaeger_total:.1f} CPU-s in all)"
    )
    overall = traced_result.requests_per_s / max(base.requests_per_s, 1e-9)
    ratio = statistics.median(ratios)
    print("per-round ratios: " + " ".join(f"{r:.3f}" for r in ratios))
    p50 = traced_result.percentile_ms(50) / max(base.percentile_ms(50), 1e-9)
    print(
        f"SUMMARY bench_tracing_overhead: {args.requests} req x2 at c={args.concurrency}, "
        f"1 image + {args.max_tokens} tok, {args.sampling:.0%} sampled into jaeger "
        f"({joined} joined traces); "
        f"{'CONTROL (both untraced); ' if args.control else ''}"
        f"req/s {base.requests_per_s:.2f} -> {traced_result.requests_per_s:.2f} "
        f"(overall {overall:.3f}; median of {len(ratios)} paired rounds {ratio:.3f}, "
        f"target >= {TARGET}: {'met' if ratio >= TARGET else 'MISSED'}), "
        f"p50 {p50:.2f}x, CPU/request {cpu_ms['traced'] / max(cpu_ms['baseline'], 1e-9):.3f}x; "
        f"{'OK' if not problems else 'FAIL'}"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
