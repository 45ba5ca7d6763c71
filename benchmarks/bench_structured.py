"""Structured-output throughput vs unconstrained, through the whole engine core, in one run.

    .venv/bin/python benchmarks/bench_structured.py [--concurrency 32] [--tokens 32]
        [--repeat 15] [--device cpu|cuda] [--threads 1]

The ``bench_engine.py`` workload (tiny LLaVA, one 64x64 image per request, ``--tokens`` greedy
tokens per request, EOS ignored) on an :class:`EngineCore` built as ``mmis engine`` builds it,
grammar engine included (``make_core(..., tokenizer_dir=...)``), one fresh core per timed run.
Sides, alternating within each of ``--repeat`` rounds:

- ``plain``: no constraint (the yardstick);
- ``json-string``: ``response_format`` json_schema ``{"answer": string (minLength 4000)}``:
  after the key, every step is inside a JSON string, the state whose mask allows the most
  tokens (the costliest fill);
- ``json-mixed``: an array (minItems 500) of ``{"id": integer 0-999, "color": enum, "ok":
  boolean}`` objects: keys, enums, numbers, booleans and separators in turn;
- ``regex``: ``[a-z ]{400,}``.

Every constraint is long enough that no request ends before ``--tokens`` (each side makes
exactly ``concurrency * tokens`` tokens; anything else is an error). Figures: median output
tokens/s and the median of the per-round ratios of each side's tokens/s to ``plain``'s (each
round's ratio printed too). The grammars are compiled before the timed runs (their cache
makes every timed request a hit); a first, untimed round warms everything up. The last line
is ``SUMMARY bench_structured: ...``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_workload import (
    ENGINE_DEFAULTS,
    build_workload,
    engine_requests,
    engine_runner,
    run_engine,
)

from mmis.engine.builder import make_core
from mmis.protocol.messages import StructuredOutputs

_ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "color", "ok"],
    "additionalProperties": False,
}
CONSTRAINTS: dict[str, StructuredOutputs | None] = {
    "plain": None,
    "json-string": StructuredOutputs(
        "json",
        json.dumps(
            {
                "type": "object",
                "properties": {"answer": {"type": "string", "minLength": 4000}},
                "required": ["answer"],
            }
        ),
    ),
    "json-mixed": StructuredOutputs(
        "json", json.dumps({"type": "array", "items": _ITEM, "minItems": 500})
    ),
    "regex": StructuredOutputs("regex", "[a-z ]{400,}"),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument(
        "--repeat",
        type=int,
        default=15,
        help="timed rounds; one round is ~0.3 s, and on a shared host single rounds' ratios "
        "spread 0.55-1.03, so the median needs many",
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoProcessor

    from mmis.engine.execution.model import load_adapter
    from mmis.tiny_models.tiny_model import build_tiny_model

    tmp = tempfile.TemporaryDirectory()
    path = build_tiny_model(Path(tmp.name) / "model", "llava")
    processor = AutoProcessor.from_pretrained(path)
    adapter = load_adapter(path, args.device, None)
    runner = engine_runner(adapter)
    items = build_workload(processor, adapter, args.concurrency)
    grammar = make_core(ENGINE_DEFAULTS, runner, tokenizer_dir=str(path)).grammar
    if grammar is None:
        raise SystemExit("bench_structured: the grammar engine did not load")

    def run(side: str) -> float:
        runner.encoder_outputs.clear()
        core = make_core(ENGINE_DEFAULTS, runner)
        core.grammar = runner.sampler.grammar = grammar  # one engine: its cache stays warm
        requests = engine_requests(items, args.tokens)
        for r in requests:
            assert r.sampling_params is not None
            r.sampling_params = msgspec.structs.replace(
                r.sampling_params, structured=CONSTRAINTS[side]
            )
        _sync(adapter.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = run_engine(core, requests)
        _sync(adapter.device)
        seconds = time.perf_counter() - start
        made = sum(len(o) for o in out)
        if made != args.concurrency * args.tokens:
            raise SystemExit(f"bench_structured: {side} made {made} tokens")
        return seconds

    for side in CONSTRAINTS:  # warm-up round (compiles the grammars), untimed
        run(side)
    times: dict[str, list[float]] = {side: [] for side in CONSTRAINTS}
    for _ in range(args.repeat):
        for side, seconds in times.items():
            seconds.append(run(side))
    total = args.concurrency * args.tokens
    print(
        f"engine core, tiny LLaVA, {args.concurrency} requests x {args.tokens} greedy tokens, "
        f"{args.device}, {args.threads} thread(s), {args.repeat} rounds"
    )
    summary: list[str] = []
    for side, seconds in times.items():
        rate = total / statistics.median(seconds)
        ratios = [p / q for p, q in zip(times["plain"], seconds, strict=True)]
        ratio = statistics.median(ratios)
        rounds = " ".join(f"{r:.2f}" for r in ratios)
        print(f"  {side:12s} {rate:9.1f} tok/s   x{ratio:.3f} of plain   (rounds: {rounds})")
        summary.append(f"{side} x{ratio:.3f}")
    print(f"grammar cache: {grammar.stats()}")
    print("SUMMARY bench_structured: " + ", ".join(summary))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
