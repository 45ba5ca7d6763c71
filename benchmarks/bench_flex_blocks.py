"""Which KV block size FlexAttention reads fastest: one decode layer at each block size.

    python benchmarks/bench_flex_blocks.py [--device cuda|cpu] [--rows 32] [--ctx 3072]
        [--heads 32] [--kv-heads 32] [--head-dim 128] [--blocks 16,32,64,128,256]
        [--peak peak.json] [--out flex_blocks.json]

For each block size: a pool holding ``rows`` contexts of ``ctx`` tokens (shuffled blocks,
as a long-running server's are), one decode step's metadata (``AttentionMetadata.build``)
and ``flex_backend.FlexBackend.attend`` (compiled; the first calls compile and warm up
outside the timing), then the median of 20 timed calls. Reported per block size: the call's
time, the K + V bytes its rows' contexts hold (``rows * ctx * kv_heads * head_dim * 2 *
itemsize``) and that over the time; with ``--peak`` (``device_peak.py``'s JSON) the time as a
multiple of those bytes at the device's copy bandwidth. Defaults: the LLaVA-1.5-7B layer at
batch 32 x 3k (``../shared/design/GPU.md``). Also times the gather path
(``TorchBackend``) at the same step as the baseline of the same run. The block size with the
lowest time is the one ``engine/config.py``'s CUDA default should take; last line:
``SUMMARY flex_blocks: ...``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def _timed(fn: Any, call: tuple[Any, ...], sync: Any, repeats: int = 20) -> float:
    for _ in range(3):
        fn(*call)
    sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn(*call)
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=3072)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--blocks", default="16,32,64,128,256")
    parser.add_argument("--peak", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    import torch

    from mmis.engine.execution.attn_backends import TorchBackend
    from mmis.engine.execution.attn_metadata import AttentionMetadata
    from mmis.engine.execution.flex_backend import FlexBackend

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    itemsize = torch.empty((), dtype=dtype).element_size()
    kv_bytes = args.rows * args.ctx * args.kv_heads * args.head_dim * 2 * itemsize
    bandwidth = None
    if args.peak is not None and args.peak.exists():
        bandwidth = json.loads(args.peak.read_text())["copy"]["gb_per_s"] * 1e9
    results: dict[str, Any] = {"rows": args.rows, "ctx": args.ctx, "kv_bytes": kv_bytes}
    per_block: dict[int, dict[str, float]] = {}
    gen = torch.Generator().manual_seed(0)
    for bs in (int(b) for b in args.blocks.split(",")):
        per_row = -(-args.ctx // bs)
        num_blocks = args.rows * per_row + 1
        order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        tables = [order[r * per_row : (r + 1) * per_row] for r in range(args.rows)]
        shape = (num_blocks, bs, args.kv_heads, args.head_dim)
        keys = torch.randn(shape, dtype=dtype, device=device)
        values = torch.randn(shape, dtype=dtype, device=device)
        meta = AttentionMetadata.build(
            [1] * args.rows, [args.ctx - 1] * args.rows, tables, bs, num_blocks * bs, device
        )
        query = torch.randn(args.rows, args.heads, args.head_dim, dtype=dtype, device=device)
        new = keys.view(-1, args.kv_heads, args.head_dim)[meta.slot_mapping]
        flex = FlexBackend(bs, device, TorchBackend())
        call = (query, keys, values, new, new, meta, None, None)
        with torch.inference_mode():
            seconds = _timed(flex.attend, call, sync)
        row = {"seconds": seconds, "gb_per_s": kv_bytes / seconds / 1e9}
        if bandwidth:
            row["x_bytes_roofline"] = seconds / (kv_bytes / bandwidth)
        per_block[bs] = row
        print(f"block {bs}: {seconds * 1e3:.3f} ms, {row['gb_per_s']:.0f} GB/s", flush=True)
        if bs == 16:  # the gather path at the server's default block size: the baseline
            gather = TorchBackend()
            with torch.inference_mode():
                base = _timed(gather.attend, call, sync)
            results["gather_seconds_block16"] = base
            print(f"gather (torch-sdpa) block 16: {base * 1e3:.3f} ms", flush=True)
        del keys, values, call
    results["blocks"] = per_block
    best = min(per_block, key=lambda b: per_block[b]["seconds"])
    results["fastest_block"] = best
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    figures = ", ".join(f"{b}: {r['seconds'] * 1e3:.2f} ms" for b, r in per_block.items())
    print(f"SUMMARY flex_blocks: fastest block {best} ({figures})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
