"""The device's yardsticks for ``scripts/gpu-check``: matmul peak and copy bandwidth.

    python benchmarks/device_peak.py [--device cuda|cpu] [--threads N] [--out peak.json]

The matmul peak is ``model_flops.matmul_peak`` (CUDA: bfloat16 8192^3; CPU: float32 1024^3)
and the copy bandwidth ``model_bytes.copy_bandwidth`` (CUDA: a 2 GiB device-to-device copy;
CPU: a 256 MiB memcpy), the same functions ``bench_engine_medium.py`` divides by. Writes them
as JSON to ``--out``; the last line is ``SUMMARY peak: ...``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from model_bytes import copy_bandwidth
from model_flops import matmul_peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    import torch

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    flops, n = matmul_peak(args.device, args.threads, dtype)
    bandwidth, nbytes = copy_bandwidth(args.device, args.threads)
    figures = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "threads": args.threads,
        "matmul": {"dtype": str(dtype).removeprefix("torch."), "n": n, "tflops": flops / 1e12},
        "copy": {"bytes": nbytes, "gb_per_s": bandwidth / 1e9},
    }
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps(figures))
    print(
        f"SUMMARY peak: {figures['device']}: matmul {figures['matmul']['dtype']} {n}^3 "
        f"{flops / 1e12:.2f} TFLOP/s, copy {nbytes >> 20} MiB {bandwidth / 1e9:.1f} GB/s "
        "(read + written)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
