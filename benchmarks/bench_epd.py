"""E/PD against aggregated serving on this machine's CPUs, split the same way (issue 46).

    .venv/bin/python benchmarks/bench_epd.py [--requests 32] [--rate 1.0] [--rounds 1]
        [--max-tokens 64] [--slo-ttft-ms 4000] [--slo-tpot-ms 250] [--model DIR]

Two layouts of the medium LLaVA (``benchmarks/medium_llava.py``: a CLIP tower, 256 image
tokens, so the tower is a real share of a request's work), each on cores 0 and 1 only:

- **aggregated**: two ``mmis serve`` replicas, one pinned to each core (``taskset``), the load
  split evenly between them (each gets a Poisson stream at half the rate: what a router that
  spreads unique images does; the picker's cache affinity has nothing to win on unique images);
- **E/PD**: one ``mmis encoder`` pinned to core 0 and one ``mmis serve --encoder-urls`` (P0 and
  P1) pinned to core 1.

Both run ``--dtype float32 --threads 1``. Workloads (``mmis bench serve``'s client,
``mmis/bench``): **image-heavy** open-loop traffic, each request 1-4 unique 640x640 JPEGs
(seeded) and ``--max-tokens`` output tokens (``ignore_eos``), then **text-only** traffic (no
image, the same output length). Figures per layout: p50/p99 TTFT, p99 TPOT, request
throughput and goodput (requests meeting both SLOs per second); the ratios E/PD /
aggregated are printed, and the per-stage costs from the servers' own metrics when present.
The targets (issue 46, from the anchors): image goodput >= 1.3x, p99 TTFT <= 0.7x, text-only
throughput >= 0.9x. Record every figure in benchmarks/README.md with the command and the
machine's load (``uptime``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

from mmis.bench.metrics import calculate_metrics
from mmis.bench.serve import run_requests

HERE = Path(__file__).resolve().parent
MMIS = str(Path(sys.executable).parent / "mmis")
DEFAULT_MODEL = Path.home() / ".cache/mmis/bench-models/medium-llava"
SERVED = "m"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _jpeg(seed: int, size: int = 640) -> str:
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 255, (size // 32, size // 32, 3), dtype=np.uint8)
    image = Image.fromarray(coarse).resize((size, size), Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def bodies(n: int, *, images: bool, max_tokens: int, seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    out = []
    next_image = seed * 100_000
    for _ in range(n):
        parts: list[dict[str, Any]] = []
        if images:
            for _ in range(int(rng.integers(1, 5))):
                parts.append({"type": "image_url", "image_url": {"url": _jpeg(next_image)}})
                next_image += 1
        words = " ".join(f"w{int(w)}" for w in rng.integers(0, 500, 40 if images else 300))
        parts.append({"type": "text", "text": f"Describe these. {words}"})
        out.append(
            {
                "model": SERVED,
                "messages": [{"role": "user", "content": parts}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
    return out


class Server:
    """One ``mmis`` process pinned to ``cores`` (``taskset``), its log in ``log``."""

    def __init__(self, args: list[str], cores: str, log: Path, env: dict[str, str]) -> None:
        self.log = log
        self._file = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            ["taskset", "-c", cores, MMIS, *args],
            stdout=self._file,
            stderr=self._file,
            env={**os.environ, **env},
            start_new_session=True,
        )

    def wait(self, url: str, timeout: float = 600) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.log} exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{url} not up within {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._file.close()


ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
COMMON = ["--served-model-name", SERVED, "--dtype", "float32", "--threads", "1"]


def start_aggregated(model: Path, logs: Path) -> tuple[list[Server], list[str]]:
    servers, urls = [], []
    for core in (0, 1):
        port = _free_port()
        args = ["serve", "--model", str(model), "--port", str(port), *COMMON]
        servers.append(Server(args, str(core), logs / f"aggregated-{core}.log", ENV))
        urls.append(f"http://127.0.0.1:{port}")
    for server, url in zip(servers, urls, strict=True):
        server.wait(url + "/ready")
    return servers, urls


def start_epd(model: Path, logs: Path) -> tuple[list[Server], list[str]]:
    endpoint, health, port = f"tcp://127.0.0.1:{_free_port()}", _free_port(), _free_port()
    encoder_args = ["encoder", "--model", str(model), "--endpoint", endpoint]
    encoder_args += ["--health-port", str(health), "--dtype", "float32", "--threads", "1"]
    encoder = Server(encoder_args, "0", logs / "encoder.log", ENV)
    encoder.wait(f"http://127.0.0.1:{health}/health")
    args = ["serve", "--model", str(model), "--port", str(port), *COMMON]
    pd = Server([*args, "--encoder-urls", endpoint], "1", logs / "pd.log", ENV)
    url = f"http://127.0.0.1:{port}"
    pd.wait(url + "/ready")
    end = time.monotonic() + 60
    while " serves EncoderKey(" not in pd.log.read_text(errors="replace"):
        if time.monotonic() > end:
            raise RuntimeError("the encoder never became live in the PD's pool")
        time.sleep(0.2)
    return [encoder, pd], [url]


async def _drive(
    urls: list[str], work: list[dict[str, Any]], rate: float, seed: int
) -> tuple[list[Any], float]:
    """Split ``work`` round-robin over ``urls``, each a Poisson stream at ``rate / len``."""
    shares = [work[i :: len(urls)] for i in range(len(urls))]
    runs = await asyncio.gather(
        *(
            run_requests(
                url + "/v1/chat/completions",
                share,
                request_rate=rate / len(urls),
                seed=seed + i,
                timeout=600,
            )
            for i, (url, share) in enumerate(zip(urls, shares, strict=True))
        )
    )
    outputs = [o for outs, _ in runs for o in outs]
    return outputs, max(duration for _, duration in runs)


def _series(url: str, name: str) -> float:
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return 0.0
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.split("{")[0].split(" ")[0] == name
    )


def measure(
    layout: str, urls: list[str], args: argparse.Namespace, round_: int
) -> dict[str, dict[str, Any]]:
    goodput = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}
    figures: dict[str, dict[str, Any]] = {}
    for kind, images, rate in (("image", True, args.rate), ("text", False, args.text_rate)):
        # a warm-up request per server (first-call costs are not the layout's)
        asyncio.run(_drive(urls, bodies(len(urls), images=images, max_tokens=4, seed=999), 100, 0))
        work = bodies(args.requests, images=images, max_tokens=args.max_tokens, seed=round_ + 1)
        outputs, duration = asyncio.run(_drive(urls, work, rate, seed=round_))
        result = calculate_metrics(outputs, duration, goodput=goodput)
        result["fallbacks"] = sum(_series(u, "mmis_encoder_fallbacks_total") for u in urls)
        figures[kind] = result
        print(
            f"{layout:<10} {kind:<5} done {result['completed']}/{len(work)}"
            f" p50 TTFT {result['median_ttft_ms']:.0f} ms, p99 TTFT {result['p99_ttft_ms']:.0f}"
            f" ms, p99 TPOT {result['p99_tpot_ms']:.0f} ms,"
            f" {result['request_throughput']:.3f} req/s, goodput"
            f" {result['request_goodput']:.3f} req/s (fallbacks {result['fallbacks']:.0f})",
            flush=True,
        )
    return figures


def stage_costs(model: Path, repeats: int = 5) -> dict[str, float]:
    """Per-stage CPU costs on one thread, in ms (medians): P0's decode + processor of one
    640x640 JPEG, the tower (+ projector) of one image, and a greedy request's language-model
    work (one image prompt's prefill + ``64`` decode steps), from the library calls the servers
    make. For the GPU projection in benchmarks/README.md."""
    import statistics

    import torch

    from mmis.engine.execution.model import load_adapter
    from mmis.frontend.client.processor import ModelProcessor

    torch.set_num_threads(1)
    processor = ModelProcessor.from_pretrained(str(model))
    raw = base64.b64decode(_jpeg(7).split(",", 1)[1])

    def p0() -> Any:
        image = Image.open(io.BytesIO(raw)).convert("RGB")
        return processor.process_image(image)

    processed = p0()
    adapter = load_adapter(str(model), "cpu", torch.float32)

    def timed(fn: Any) -> float:
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            with torch.inference_mode():
                fn()
            runs.append((time.perf_counter() - t0) * 1000)
        return statistics.median(runs)

    return {
        "p0_image_ms": timed(p0),
        "tower_image_ms": timed(lambda: adapter.encode_images([processed.tensors])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=1.0, help="image requests per second")
    parser.add_argument("--text-rate", type=float, default=2.0, help="text requests per second")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--slo-ttft-ms", type=float, default=4000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=250.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--logs", type=Path, default=Path("/tmp/bench-epd"))
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    parser.add_argument(
        "--stages", action="store_true", help="also time P0's image work and the tower alone"
    )
    args = parser.parse_args()
    if not (args.model / "config.json").exists():
        cmd = [sys.executable, str(HERE / "medium_llava.py"), str(args.model), "--shape", "medium"]
        subprocess.run(cmd, check=True)
    args.logs.mkdir(parents=True, exist_ok=True)
    print(f"load: {os.getloadavg()}", flush=True)
    results: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        row: dict[str, Any] = {}
        for layout, start in (("aggregated", start_aggregated), ("epd", start_epd)):
            servers, urls = start(args.model, args.logs)
            try:
                row[layout] = measure(layout, urls, args, round_)
            finally:
                for server in reversed(servers):
                    server.stop()
        results.append(row)
        a, e = row["aggregated"], row["epd"]
        print(
            f"round {round_}: E/PD / aggregated: image goodput x"
            f"{e['image']['request_goodput'] / max(a['image']['request_goodput'], 1e-9):.2f},"
            f" p99 TTFT x{e['image']['p99_ttft_ms'] / a['image']['p99_ttft_ms']:.2f},"
            f" p99 TPOT x{e['image']['p99_tpot_ms'] / a['image']['p99_tpot_ms']:.2f};"
            f" text throughput x"
            f"{e['text']['request_throughput'] / a['text']['request_throughput']:.2f},"
            f" text p99 TTFT x{e['text']['p99_ttft_ms'] / a['text']['p99_ttft_ms']:.2f}",
            flush=True,
        )
    if args.stages:
        print(f"stages (one thread, ms): {stage_costs(args.model)}", flush=True)
    print(f"load: {os.getloadavg()}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
