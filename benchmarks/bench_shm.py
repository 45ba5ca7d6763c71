"""Throughput of the shared-memory object store against a plain memcpy, in the same run.

Each store iteration does what P0 and P1 do for one image: ``put`` (one copy into the
mapping), ``read`` (zero-copy views), a copy out into a preallocated buffer (what the engine
does when it moves the tensors to their destination), ``ack`` and ``reclaim``. The baseline
moves the same bytes with two numpy copies: into a preallocated buffer and back out. Both
count the payload bytes once per iteration; the figure of merit is store / memcpy (target
>= 0.5). A second store figure uses ``read(copy=True)`` (freshly allocated arrays).

Run: ``.venv/bin/python benchmarks/bench_shm.py [--iterations N] [--tiles T] [--dir DIR]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from mmis.shm import ShmReader, ShmWriter

Payload = dict[str, np.ndarray]


def make_payload(tiles: int) -> Payload:
    """Processor output for one image split into 448x448 tiles (float32, CHW)."""
    rng = np.random.default_rng(0)
    return {
        "pixel_values": rng.standard_normal((tiles, 3, 448, 448), dtype=np.float32),
        "image_sizes": np.array([[448, 448 * tiles]], dtype=np.int64),
        "num_tiles": np.array([tiles], dtype=np.int64),
    }


def nbytes(payload: Payload) -> int:
    return sum(a.nbytes for a in payload.values())


def timed(step: Callable[[], Any], iterations: int, rounds: int) -> float:
    """Median seconds per iteration over ``rounds`` rounds (after one warm-up round)."""
    for _ in range(max(1, iterations // 10)):
        step()
    per_round = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(iterations):
            step()
        per_round.append((time.perf_counter() - start) / iterations)
    return statistics.median(per_round)


def memcpy_step(payload: Payload) -> Callable[[], None]:
    staging = {k: np.empty_like(a) for k, a in payload.items()}
    out = {k: np.empty_like(a) for k, a in payload.items()}

    def step() -> None:
        for k, a in payload.items():
            np.copyto(staging[k], a)
            np.copyto(out[k], staging[k])

    return step


def store_step(writer: ShmWriter, reader: ShmReader, payload: Payload) -> Callable[[], None]:
    out = {k: np.empty_like(a) for k, a in payload.items()}

    def step() -> None:
        address = writer.put(payload)
        views = reader.read(address)
        for k, v in views.items():
            np.copyto(out[k], v)
        del views
        reader.ack(address)
        writer.reclaim()

    return step


def store_copy_step(writer: ShmWriter, reader: ShmReader, payload: Payload) -> Callable[[], None]:
    def step() -> None:
        address = writer.put(payload)
        reader.read(address, copy=True)
        reader.ack(address)
        writer.reclaim()

    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tiles", type=int, default=4, help="448x448 float32 tiles per item")
    parser.add_argument("--dir", default="/dev/shm", help="segment directory")
    args = parser.parse_args(argv)

    payload = make_payload(args.tiles)
    size = nbytes(payload)
    with (
        tempfile.TemporaryDirectory(dir=args.dir) as directory,
        ShmWriter(8 * size, directory=directory, put_timeout_s=0.0) as writer,
        ShmReader(writer.segment, directory=directory) as reader,
    ):
        t_store = timed(store_step(writer, reader, payload), args.iterations, args.rounds)
        t_copy = timed(store_copy_step(writer, reader, payload), args.iterations, args.rounds)
        t_memcpy = timed(memcpy_step(payload), args.iterations, args.rounds)
        stats = writer.stats()
    if stats.used != 0 or stats.expired_handles != 0:
        print(f"store did not reclaim everything: {stats}", file=sys.stderr)
        return 1

    gbps = {
        k: size / t / 1e9 for k, t in (("store", t_store), ("copy", t_copy), ("memcpy", t_memcpy))
    }
    ratio = gbps["store"] / gbps["memcpy"]
    print(f"payload: {size / 2**20:.2f} MiB ({args.tiles} x 3x448x448 float32 + metadata)")
    print(f"iterations: {args.iterations} x {args.rounds} rounds (median), dir {args.dir}")
    print(f"memcpy baseline (copy in + copy out):        {gbps['memcpy']:6.2f} GB/s")
    print(f"store put + zero-copy read + copy out + ack: {gbps['store']:6.2f} GB/s")
    print(f"store put + read(copy=True) + ack:           {gbps['copy']:6.2f} GB/s")
    print(f"reclaimed: {stats.reclaimed_handles} handles, {stats.reclaimed_bytes / 2**30:.2f} GiB")
    verdict = "PASS" if ratio >= 0.5 else "BELOW TARGET"
    print(
        f"SUMMARY bench_shm: {size / 2**20:.1f} MiB items, store {gbps['store']:.2f} GB/s vs "
        f"memcpy {gbps['memcpy']:.2f} GB/s = {ratio:.2f}x (target >= 0.5, {verdict}); "
        f"read(copy=True) {gbps['copy'] / gbps['memcpy']:.2f}x"
    )
    return 0 if ratio >= 0.5 else 2


if __name__ == "__main__":
    sys.exit(main())
