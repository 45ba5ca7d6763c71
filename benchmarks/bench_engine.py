"""Batched paged runner vs naive per-request ``generate()``: output tokens per second.

    .venv/bin/python benchmarks/bench_engine.py [--family llava|qwen2-vl]
        [--concurrency 1 8 32] [--tokens 16] [--repeat 3] [--device cpu|cuda]
        [--threads 1] [--check]

Workload, identical for both sides: ``c`` requests, each a chat prompt with its own 64x64
image (processor already run: both sides start from the same tensors), ``--tokens`` greedy
output tokens each (EOS ignored, so both sides produce exactly the same number of tokens).

- baseline: plain transformers, one ``model.generate(do_sample=False)`` per request, in turn
  (what a server without continuous batching does);
- ours: :class:`ModelRunner` with all ``c`` requests in flight, one forward per step: a
  batched prefill step (encoder once for all images), then batched decode steps.

Both are measured in the same run (best of ``--repeat``); the ratio is ours / baseline.
The first greedy tokens of both sides are compared, so a fast but wrong runner cannot win.
``--check`` exits non-zero if the ratio at the highest concurrency is below the target.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmis.server.engine.model import ModelAdapter, load_adapter
from mmis.server.engine.runner import ModelRunner
from mmis.server.engine.step_batch import MultiModalInput, ScheduledSequence, StepBatch
from mmis.server.engine.tiny_model import build_tiny_model

TARGET = 2.0  # at the highest concurrency


def _requests(
    processor: Any, adapter: ModelAdapter, count: int
) -> list[tuple[Any, list[int], list[MultiModalInput]]]:
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}],
        }
    ]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    image_token = int(adapter.model.config.image_token_id)
    out = []
    for k in range(count):
        pixels = np.random.default_rng(k).integers(0, 255, (64, 64, 3), dtype=np.uint8)
        inputs = processor(text=[prompt], images=[Image.fromarray(pixels)], return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
        offset = ids.index(image_token)
        length = ids.count(image_token)
        (data,) = adapter.split_processor_output(inputs)
        out.append((inputs, ids, [MultiModalInput(f"img-{k}", offset, length, data=data)]))
    return out


def run_baseline(model: Any, requests: list[Any], tokens: int) -> list[list[int]]:
    results = []
    for inputs, ids, _ in requests:
        gen = model.generate(**inputs, max_new_tokens=tokens, do_sample=False, eos_token_id=[])
        results.append(gen[0, len(ids) :].tolist())
    return results


def run_ours(runner: ModelRunner, requests: list[Any], tokens: int) -> list[list[int]]:
    block = runner.block_size
    runner.encoder_outputs.clear()
    tables, outputs = [], [[] for _ in requests]  # type: ignore[var-annotated]
    next_block = 0
    for _, ids, _ in requests:
        need = (len(ids) + tokens + block - 1) // block
        tables.append(list(range(next_block, next_block + need)))
        next_block += need
    seqs = [
        ScheduledSequence(f"r{k}", ids, 0, tables[k], items)
        for k, (_, ids, items) in enumerate(requests)
    ]
    for _ in range(tokens):
        out = runner.execute(StepBatch(seqs))
        nxt = []
        for k, seq in enumerate(seqs):
            token = out.sampled_token_ids[seq.request_id]
            outputs[k].append(token)
            items = [dataclasses.replace(it, data=None) for it in seq.mm_items]
            nxt.append(
                ScheduledSequence(seq.request_id, [token], seq.end_position, seq.block_table, items)
            )
        seqs = nxt
    return outputs


def _best(fn: Any, repeat: int) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        with torch.inference_mode():
            result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="llava", choices=["llava", "qwen2-vl"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (both sides)")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForImageTextToText, AutoProcessor

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp) / "model", args.family)
        processor = AutoProcessor.from_pretrained(path)
        dtype = torch.float32
        baseline = (
            AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).to(args.device).eval()
        )
        adapter = load_adapter(path, args.device, dtype)
    max_c = max(args.concurrency)
    runner = ModelRunner.create(adapter, num_blocks=max_c * ((80 + args.tokens) // 16 + 2))
    print(
        f"{args.family} on {args.device} ({args.threads} CPU threads), {args.tokens} output "
        f"tokens per request, best of {args.repeat}"
    )
    print(f"{'concurrency':>11} {'baseline tok/s':>15} {'ours tok/s':>11} {'ratio':>7}")
    ratio = 0.0
    for c in args.concurrency:
        requests = _requests(processor, adapter, c)
        if args.device != "cpu":
            requests = [(inp.to(args.device), ids, items) for inp, ids, items in requests]
        t_base, ref = _best(lambda r=requests: run_baseline(baseline, r, args.tokens), args.repeat)
        t_ours, got = _best(lambda r=requests: run_ours(runner, r, args.tokens), args.repeat)
        if [g[:4] for g in got] != [r[:4] for r in ref]:
            print(f"  warning: first greedy tokens differ at concurrency {c}", file=sys.stderr)
        total = c * args.tokens
        ratio = t_base / t_ours
        print(f"{c:>11} {total / t_base:>15.1f} {total / t_ours:>11.1f} {ratio:>6.2f}x")
    if args.check and ratio < TARGET:
        print(f"ratio {ratio:.2f}x below target {TARGET}x", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
