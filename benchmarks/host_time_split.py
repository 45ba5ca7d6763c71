"""Where a request's host time goes at defaults: CPU seconds per request, by process and thread.

Issue 45's profile of ``mmis serve`` at its own thread defaults. It starts one ``mmis serve``
(the vLLM peer's ``tiny-llava-vllm`` copy when it exists, else the built-in tiny model), sends
each workload (``unique`` / ``repeated`` 64x64 PNGs, ``text``; the requests of
``bench_vs_vllm.py``) once as a warm-up and once measured, and reads every thread's CPU time
(``/proc/PID/task/TID/stat``: utime + stime) of every process of the server before and after
the measured round. Per workload it prints the CPU milliseconds per request of P0 (the serve
process and any front-end children) and P1 (the engine process), and the threads that spent
the most, grouped by thread name (numbered thread names, e.g. torch's pool, fold into one).

    .venv/bin/python benchmarks/host_time_split.py [--requests 64] [--concurrency 16]
        [--tokens 16] [--api-servers 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_vllm import PEER_ROOT, REPEATED_POOL, load, wait_quiet
from serve_client import ServerProcess

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            children = task / "children"
            if children.exists():
                todo += [int(c) for c in children.read_text().split()]
    return out


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def thread_times(root: int) -> Counter[tuple[str, str]]:
    """CPU seconds so far of every thread under ``root``: (P0|P1, thread name) -> seconds."""
    times: Counter[tuple[str, str]] = Counter()
    for pid in _tree(root):
        side = "P1" if " engine" in _cmd(pid) else "P0"
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            name = re.sub(r"[-_]?\d+$", "", name) or name
            times[(side, name)] += (int(fields[11]) + int(fields[12])) * TICK_S
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--api-servers", type=int, default=1)
    args = parser.parse_args(argv)
    model_dir = PEER_ROOT / "tiny-llava-vllm"
    served = ["--served-model-name", "tiny"]
    if (model_dir / "config.json").exists():
        served = ["--model", str(model_dir), *served]
    if args.api_servers > 1:
        served += ["--api-servers", str(args.api_servers)]
    work = tempfile.TemporaryDirectory()
    os.chdir(work.name)
    server = ServerProcess.mmis_serve("mmis", served, Path(work.name))
    try:
        base = server.root_url
        asyncio.run(load(base, "tiny", 4, REPEATED_POOL, REPEATED_POOL, 0, "repeated"))
        print(f"mmis serve {' '.join(served)}; c={args.concurrency}, {args.tokens} tokens")
        for i, workload in enumerate(("unique", "repeated", "text")):
            asyncio.run(load(base, "tiny", args.tokens, 16, 16, 50 + i, workload))
            wait_quiet()
            before = thread_times(server.popen.pid)
            wall, _ = asyncio.run(
                load(base, "tiny", args.tokens, args.requests, args.concurrency, i, workload)
            )
            spent = thread_times(server.popen.pid)
            spent.subtract(before)
            per = {k: v / args.requests * 1000 for k, v in spent.items() if v > 0}
            p0 = sum(v for (side, _), v in per.items() if side == "P0")
            p1 = sum(v for (side, _), v in per.items() if side == "P1")
            print(
                f"{workload:8s} {args.requests / wall:6.1f} req/s  CPU ms/request: "
                f"P0 {p0:6.2f}  P1 {p1:6.2f}"
            )
            for (side, name), ms in sorted(per.items(), key=lambda kv: -kv[1])[:8]:
                print(f"           {side} {name:24s} {ms:6.2f}")
    finally:
        server.stop()
        work.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
