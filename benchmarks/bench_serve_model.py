"""``mmis serve`` on a given model under concurrent streamed image chats, without and with
forced cache eviction: non-2xx, identical outputs, requests/s and p50 time to first token.

    python benchmarks/bench_serve_model.py --model DIR [--requests 128] [--concurrency 32]
        [--images 32] [--max-tokens 32] [--fault-evict-rate 0.3] [--rounds 2]
        [--serve-args "--kv-cache-gb 24"] [--timeout 120] [--ready-timeout 240] [--threads 1]

``scripts/gpu-check`` runs it on the GPU with the random LLaVA-1.5-7B shape
(``medium_llava.py``) and, in ``--dry-run``, on CPU with its mini version. It is
``bench_serve_load.py``'s A/B (the same two servers, request list, interleaved rounds,
``/metrics`` counters and checks), with streamed requests so that the time to first token is
measured too:

- two ``mmis serve`` processes on ``--model``: the baseline and one with
  ``--fault-evict-rate`` (P1 evicts that fraction of the cached items it is sent on purpose,
  so P0's shadow hits turn into drift misses that the retry heals); both get
  ``--serve-args`` (e.g. a fixed ``--kv-cache-gb``, so two engines share one GPU);
- after a warm-up, both get the same ``--requests`` greedy chats (``stream: true``, fixed
  ``--max-tokens``, image i mod ``--images``), ``--concurrency`` in flight, in ``--rounds``
  chunks alternating between the servers;
- per request: status, time to the first content chunk (TTFT), time to the end, the text
  (the load loop and client of ``mmis bench serve``, :mod:`mmis.bench`).

Checks (exit status 1 if any fails): zero non-2xx, zero hangs or broken streams, one and the
same completion per image in both runs, at least one drift miss in the eviction run. The last
line is ``SUMMARY serve_load: ...`` with the ratios (eviction run / baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shlex
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from bench_serve_load import DRIFT_MISSES, RETRIES, _counter_delta, _sum
from serve_client import ServerProcess, chat_body, image_data_url

from mmis.bench.metrics import percentile
from mmis.bench.serve import run_requests


@dataclasses.dataclass
class StreamResult:
    """What one server's streamed requests measured: the outcome counts, each answered
    request's TTFT and latency (seconds, as ``mmis bench serve``'s client measures them) and
    each request key's distinct completion texts. Invariant: ``ok == len(ttfts_s) ==
    len(latencies_s)``; a request is counted once, as ok, non-2xx, a hang or an error."""

    wall_s: float = 0.0
    ttfts_s: list[float] = dataclasses.field(default_factory=list)
    latencies_s: list[float] = dataclasses.field(default_factory=list)
    statuses: Counter[int] = dataclasses.field(default_factory=Counter)
    hangs: int = 0
    errors: Counter[str] = dataclasses.field(default_factory=Counter)
    outputs: dict[str, set[str]] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> int:
        return len(self.ttfts_s)

    @property
    def non_2xx(self) -> int:
        return sum(n for code, n in self.statuses.items() if not 200 <= code < 300)

    @property
    def failed(self) -> int:
        return self.non_2xx + self.hangs + sum(self.errors.values())

    @property
    def requests_per_s(self) -> float:
        return self.ok / self.wall_s if self.wall_s else 0.0

    def p50_ttft_ms(self) -> float:
        return percentile(self.ttfts_s, 50) * 1000

    def percentile_ms(self, q: float) -> float:
        return percentile(self.latencies_s, q) * 1000

    def merge(self, other: StreamResult) -> None:
        self.wall_s += other.wall_s
        self.ttfts_s += other.ttfts_s
        self.latencies_s += other.latencies_s
        self.statuses.update(other.statuses)
        self.hangs += other.hangs
        self.errors.update(other.errors)
        for key, outs in other.outputs.items():
            self.outputs.setdefault(key, set()).update(outs)


async def run_stream_load(
    url: str, requests: list[tuple[str, dict[str, Any]]], concurrency: int, timeout: float
) -> StreamResult:
    """POST each ``(key, body)`` to ``url`` once, streamed, ``concurrency`` at a time: the
    closed loop and client of ``mmis bench serve`` (:func:`mmis.bench.serve.run_requests`).
    TTFT is the time to the first chunk with generated text; a request past ``timeout`` is a
    hang, one with no answer or a 200 stream that broke off (an error chunk, no ``[DONE]``,
    no text) an error, by cause."""
    bodies = [{**body, "stream": True} for _, body in requests]
    outputs, wall = await run_requests(url, bodies, max_concurrency=concurrency, timeout=timeout)
    result = StreamResult(wall_s=wall)
    for (key, _), out in zip(requests, outputs, strict=True):
        if out.exception == "TimeoutError":
            result.hangs += 1
        elif out.status is None:
            result.errors[out.exception or "no answer"] += 1
        else:
            result.statuses[out.status] += 1
            if out.success:
                result.ttfts_s.append(out.ttft)
                result.latencies_s.append(out.latency)
                result.outputs.setdefault(key, set()).add(out.generated_text)
            elif out.status == 200:
                result.errors[f"stream: {out.error[:200]}"] += 1
    return result


def _describe(name: str, result: StreamResult, delta: dict[str, float]) -> str:
    return (
        f"{name:>9}: {result.ok} ok, non-2xx {result.non_2xx}, hangs {result.hangs}, "
        f"errors {dict(result.errors)}; {result.requests_per_s:.2f} req/s, p50 TTFT "
        f"{result.p50_ttft_ms():.0f} ms, p50 latency {result.percentile_ms(50):.0f} ms, p99 "
        f"{result.percentile_ms(99):.0f} ms; drift misses {_sum(delta, DRIFT_MISSES)}, retries "
        f"{_sum(delta, RETRIES)}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=64, help="pixels per side")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--fault-evict-rate", type=float, default=0.3)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved chunks per server")
    parser.add_argument("--serve-args", default="", help="more `mmis serve` flags, both servers")
    parser.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    parser.add_argument("--ready-timeout", type=float, default=240.0, help="server start-up")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads (0: default)")
    args = parser.parse_args(argv)

    extra = shlex.split(args.serve_args)
    common = ["--model", args.model, "--served-model-name", "bench", "--seed", "0"]
    common += ["--max-num-seqs", str(max(args.concurrency, 16)), *extra]
    knob = ["--fault-evict-rate", str(args.fault_evict_rate)]
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    images = [image_data_url(seed, args.image_size) for seed in range(args.images)]
    requests = [
        (f"image-{i % args.images}", chat_body("bench", images[i % args.images], args.max_tokens))
        for i in range(args.requests)
    ]
    warm = [("warm", chat_body("bench", image_data_url(10_000, args.image_size), 2))] * 4
    servers: dict[str, ServerProcess] = {}
    results: dict[str, StreamResult] = {}
    deltas: dict[str, dict[str, float]] = {}
    startup: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-serve-model-") as tmp:
        try:
            for name, flags in (("baseline", common), ("evict", [*common, *knob])):
                servers[name] = ServerProcess.mmis_serve(name, flags, Path(tmp), env)
            for name, server in servers.items():
                startup[name] = server.wait_http("/ready", args.ready_timeout)
                print(f"{name} ready after {startup[name]:.1f} s", flush=True)
            url = {n: s.root_url + "/v1/chat/completions" for n, s in servers.items()}
            before = {}
            for name, server in servers.items():
                asyncio.run(run_stream_load(url[name], warm, len(warm), args.timeout))
                before[name] = server.metrics()
            chunk = -(-len(requests) // args.rounds)
            order = list(servers)
            for round_, first in enumerate(range(0, len(requests), chunk)):
                for name in order if round_ % 2 == 0 else order[::-1]:
                    part = requests[first : first + chunk]
                    got = asyncio.run(
                        run_stream_load(url[name], part, args.concurrency, args.timeout)
                    )
                    results.setdefault(name, StreamResult()).merge(got)
                    print(f"round {round_ + 1} {_describe(name, got, {})}", flush=True)
            for name, server in servers.items():
                deltas[name] = _counter_delta(before[name], server.metrics())
        finally:
            for name, server in servers.items():
                code = server.stop()
                if code != 0 or name not in deltas:
                    print(f"{name} exited with {code}; its log:\n{server.log_tail()}", flush=True)
    base, evict = results["baseline"], results["evict"]
    print(
        f"{Path(args.model).name}: {args.requests} streamed image chats x2 at "
        f"c={args.concurrency}, {args.images} images, {args.max_tokens} tokens; startup to "
        f"/ready {startup['baseline']:.1f} s / {startup['evict']:.1f} s"
    )
    print(_describe("baseline", base, deltas["baseline"]))
    print(_describe(f"evict {args.fault_evict_rate}", evict, deltas["evict"]))
    problems = []
    for name, result in results.items():
        if result.failed:
            problems.append(f"{name}: {result.failed} requests without a whole 2xx answer")
        unstable = [k for k, outs in result.outputs.items() if len(outs) != 1]
        if unstable:
            problems.append(f"{name}: images with more than one output: {unstable[:5]}")
    differ = [k for k in base.outputs if base.outputs[k] != evict.outputs.get(k)]
    if differ:
        problems.append(f"outputs differ between the runs for {len(differ)} images: {differ[:5]}")
    misses = _sum(deltas["evict"], DRIFT_MISSES)
    if not misses:
        problems.append("the eviction run saw no drift miss: the fault knob did not bite")
    for problem in problems:
        print("FAIL:", problem)
    rps = evict.requests_per_s / max(base.requests_per_s, 1e-9)
    ttft = evict.p50_ttft_ms() / max(base.p50_ttft_ms(), 1e-9)
    print(
        f"SUMMARY serve_load: {Path(args.model).name} {args.requests} req x2 c={args.concurrency} "
        f"{args.max_tokens} tok: {'OK' if not problems else 'FAIL'}; non-2xx "
        f"{base.non_2xx}+{evict.non_2xx}, failed {base.failed}+{evict.failed}, outputs "
        f"identical {not differ} ({len(differ)}/{len(base.outputs)} images differ); req/s "
        f"{base.requests_per_s:.2f}->{evict.requests_per_s:.2f} ({rps:.2f}x), p50 TTFT "
        f"{base.p50_ttft_ms():.0f}->{evict.p50_ttft_ms():.0f} ms ({ttft:.2f}x); evict "
        f"{args.fault_evict_rate}: drift misses {misses}, retries {_sum(deltas['evict'], RETRIES)}"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
