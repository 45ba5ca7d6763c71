"""The sampler's cost with and without penalties, and the engine's with penalties on.

    .venv/bin/python benchmarks/bench_sampler.py [--rows 32] [--vocab 448 32000 152064]
        [--history 128 2048] [--steps 20] [--repeat 11] [--device cpu|cuda] [--threads 1]
        [--engine-concurrency 32] [--tokens 16] [--no-engine]

Part 1, the sampler alone: one decode step of ``--rows`` rows over a ``[rows, vocab]`` float32
logits batch, timed per step over ``--repeat`` rounds of ``--steps`` steps, the sides
alternating within each round; each figure is the median over the rounds, each ratio the
median of the per-round ratios to ``before``. Sides:

- ``before``: the sampler as it was before penalties existed (commit a94c3cc, kept verbatim
  below as :class:`BaselineSampler`): the yardstick every ratio is divided by;
- ``fast``: today's sampler on the same batch (no bias, no penalty): the fast path, which must
  cost the same;
- ``incremental``: every row with a frequency, presence and repetition penalty, its token
  history (``--history`` prompt + output tokens, one more output token per step) counted by
  :class:`TokenHistoryCache` across steps, as the runner keeps it;
- ``rebuilt``: the same, but the counts rebuilt from the token lists at every step (the cache
  cleared before each one): the alternative the cache was chosen against.

Each of the two param mixes is measured: ``greedy`` (temperature 0) and ``sampled``
(temperature 1, top-p 0.9).

Part 2, the whole engine core (``--no-engine`` skips it, ``--no-sampler`` skips part 1): the
``bench_engine.py`` workload (tiny LLaVA, one 64x64 image per request, ``--tokens`` greedy
tokens, EOS ignored) at ``--engine-concurrency``, plain vs every request with
``frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.1`` vs every request with
``logprobs=5``; median output tokens/s and the median of the per-round ratios.

The last line is ``SUMMARY bench_sampler: ...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

from mmis.engine.execution.sampler import GREEDY_EPSILON, Sampler, SamplingParamsError, seed_for
from mmis.engine.execution.token_history import TokenHistoryCache
from mmis.protocol.messages import SamplingParams


class BaselineSampler:
    """The sampler of commit a94c3cc (before penalties), verbatim but for its name."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams | None],
        positions: Sequence[int],
    ) -> torch.Tensor:
        if logits.ndim != 2 or logits.shape[0] != len(params) or len(params) != len(positions):
            raise SamplingParamsError("shape")
        for p in params:
            if p is not None:
                _baseline_validate(p)
        logits = logits.float()
        greedy_rows = [p is None or p.temperature < GREEDY_EPSILON for p in params]
        argmax = logits.argmax(dim=-1)
        if all(greedy_rows):
            return argmax
        probs = self._probabilities(logits, params)
        noise = torch.empty_like(probs).exponential_()
        for i, p in enumerate(params):
            if p is not None and p.seed is not None and not greedy_rows[i]:
                gen = torch.Generator(device=probs.device).manual_seed(
                    seed_for(p.seed, positions[i])
                )
                noise[i].exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        greedy = torch.tensor(greedy_rows, device=logits.device)
        return torch.where(greedy, argmax, sampled)

    @staticmethod
    def _probabilities(
        logits: torch.Tensor, params: Sequence[SamplingParams | None]
    ) -> torch.Tensor:
        vocab = logits.shape[-1]
        temps, top_k, top_p = [], [], []
        for p in params:
            sampling = p is not None and p.temperature >= GREEDY_EPSILON
            temps.append(p.temperature if p is not None and sampling else 1.0)
            k = p.top_k if p is not None else 0
            top_k.append(k if 0 < k < vocab else vocab)
            top_p.append(p.top_p if p is not None and p.top_p < 1.0 else float("inf"))
        device = logits.device
        scaled = logits / torch.tensor(temps, device=device).unsqueeze(1)
        if min(top_k) == vocab and min(top_p) == float("inf"):
            return torch.softmax(scaled, dim=-1)
        ordered, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device).unsqueeze(0)
        drop = rank >= torch.tensor(top_k, device=device).unsqueeze(1)
        ordered = ordered.masked_fill(drop, float("-inf"))
        sorted_probs = torch.softmax(ordered, dim=-1)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = before >= torch.tensor(top_p, device=device).unsqueeze(1)
        drop[:, 0] = False
        ordered = ordered.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(scaled, float("-inf")).scatter(-1, order, ordered)
        return torch.softmax(filtered, dim=-1)


def _baseline_validate(params: SamplingParams) -> None:
    if params.temperature < 0:
        raise SamplingParamsError("temperature")
    if not 0 < params.top_p <= 1:
        raise SamplingParamsError("top_p")
    if params.top_k < -1:
        raise SamplingParamsError("top_k")


@dataclasses.dataclass
class _Hist:
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sampler_sides(
    rows: int, vocab: int, history: int, mix: str, device: torch.device
) -> dict[str, Callable[[int], Any]]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen).to(device)
    if mix == "greedy":
        plain = SamplingParams(temperature=0.0)
    else:
        plain = SamplingParams(temperature=1.0, top_p=0.9)
    penal = msgspec.structs.replace(
        plain, frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.1
    )
    prompt_len = history // 2
    hists = [
        _Hist(
            torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(),
            torch.randint(0, vocab, (history - prompt_len,), generator=gen).tolist(),
        )
        for _ in range(rows)
    ]
    ids = [f"r{k}" for k in range(rows)]
    positions = [history] * rows
    before, now = BaselineSampler(), Sampler()
    caches = {"incremental": TokenHistoryCache(), "rebuilt": TokenHistoryCache()}

    def penalized(name: str) -> Callable[[int], Any]:
        cache = caches[name]
        mine = [_Hist(list(h.prompt_token_ids), list(h.output_token_ids)) for h in hists]

        def step(k: int) -> Any:
            if name == "rebuilt":
                cache.clear()
            for h in mine:  # the token the previous step sampled
                h.output_token_ids.append(k % vocab)
            counts = cache.counts(
                list(range(rows)), ids, mine, with_prompt=True, vocab_size=vocab, device=device
            )
            return now(logits, [penal] * rows, positions, counts)

        return step

    return {
        "before": lambda k: before(logits, [plain] * rows, positions),
        "fast": lambda k: now(logits, [plain] * rows, positions),
        "incremental": penalized("incremental"),
        "rebuilt": penalized("rebuilt"),
    }


def _time_sides(
    sides: dict[str, Callable[[int], Any]], steps: int, repeat: int, device: torch.device
) -> dict[str, tuple[float, float]]:
    """Per side: (median seconds per step, median of the per-round ratios to ``before``).
    Sides alternate within each round, so a burst of load on the shared machine hits a
    round's sides alike; the median of the per-round ratios discounts bursts between rounds.
    """
    for side in sides.values():  # warm-up (allocator, first-call costs), untimed
        side(0)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeat):
        for name, side in sides.items():
            _sync(device)
            start = time.perf_counter()
            with torch.inference_mode():
                for k in range(steps):
                    side(k)
            _sync(device)
            times[name].append((time.perf_counter() - start) / steps)
    base = times["before"]
    return {
        name: (
            statistics.median(t),
            statistics.median(x / b for x, b in zip(t, base, strict=True)),
        )
        for name, t in times.items()
    }


def _engine_part(
    concurrency: int, tokens: int, repeat: int, device: str
) -> dict[str, tuple[float, float]]:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_workload import (
        build_workload,
        engine_core,
        engine_requests,
        engine_runner,
        run_engine,
    )
    from transformers import AutoProcessor

    from mmis.engine.execution.model import load_adapter
    from mmis.tiny_models.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp) / "model", "llava")
        processor = AutoProcessor.from_pretrained(path)
        adapter = load_adapter(path, device, None)
    runner = engine_runner(adapter)
    items = build_workload(processor, adapter, concurrency)

    def requests(side: str) -> list[Any]:
        reqs = engine_requests(items, tokens)
        for r in reqs:
            assert r.sampling_params is not None
            if side == "penalties":
                r.sampling_params.frequency_penalty = 0.5
                r.sampling_params.presence_penalty = 0.5
                r.sampling_params.repetition_penalty = 1.1
            elif side == "logprobs":  # each token's logprob and its 5 likeliest alternatives
                r.sampling_params.logprobs = 5
        return reqs

    times: dict[str, list[float]] = {"plain": [], "penalties": [], "logprobs": []}
    for _ in range(repeat):
        for name, seconds in times.items():
            core, reqs = engine_core(runner), requests(name)
            _sync(adapter.device)
            start = time.perf_counter()
            with torch.inference_mode():
                out = run_engine(core, reqs)
            _sync(adapter.device)
            seconds.append(time.perf_counter() - start)
            if sum(len(o) for o in out) != concurrency * tokens:
                raise RuntimeError(f"{name}: wrong number of tokens")
    total = concurrency * tokens
    return {  # side -> (median tok/s, median per-round ratio of its tok/s over plain's)
        name: (
            total / statistics.median(seconds),
            statistics.median(p / q for p, q in zip(times["plain"], seconds, strict=True)),
        )
        for name, seconds in times.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, nargs="+", default=[448, 32000, 152064])
    parser.add_argument("--history", type=int, nargs="+", default=[128, 2048])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=11)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--engine-concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--no-engine", dest="engine", action="store_false")
    parser.add_argument("--no-sampler", dest="sampler", action="store_false", help="part 2 only")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"sampler on {device}, {args.rows} rows, {args.threads} CPU threads, "
        f"median of {args.repeat} rounds x {args.steps} steps; ratios: median per-round "
        "side / before"
    )
    print(
        f"{'mix':>7} {'vocab':>7} {'history':>8} {'before us':>10} {'fast':>12} "
        f"{'fast-before':>11} {'incremental':>16} {'rebuilt':>16}"
    )
    figures: list[str] = []
    for mix in ("greedy", "sampled") if args.sampler else ():
        for vocab in args.vocab:
            for history in args.history:
                sides = _sampler_sides(args.rows, vocab, history, mix, device)
                t = _time_sides(sides, args.steps, args.repeat, device)
                base = t["before"][0]

                def cell(name: str, width: int, t: dict[str, tuple[float, float]] = t) -> str:
                    return f"{t[name][0] * 1e6:.0f}us {t[name][1]:.2f}x".rjust(width)

                extra = (t["fast"][0] - base) * 1e6
                print(
                    f"{mix:>7} {vocab:>7} {history:>8} {base * 1e6:>8.0f}us "
                    f"{cell('fast', 12)} {extra:>+9.1f}us "
                    f"{cell('incremental', 16)} {cell('rebuilt', 16)}",
                    flush=True,
                )
                figures.append(
                    f"{mix} V={vocab} L={history}: fast {t['fast'][1]:.2f}x "
                    f"incr {t['incremental'][1]:.2f}x rebuilt {t['rebuilt'][1]:.2f}x"
                )
    engine = ""
    if args.engine:
        sides = _engine_part(
            args.engine_concurrency, args.tokens, max(3, args.repeat // 2), args.device
        )
        print(
            f"engine c={args.engine_concurrency}: "
            + ", ".join(f"{n} {tps:.1f} tok/s ({r:.2f}x)" for n, (tps, r) in sides.items())
            + " (ratios: median per-round tok/s over plain's)"
        )
        engine = (
            f"; engine c={args.engine_concurrency} penalties/plain {sides['penalties'][1]:.2f}x"
            f" logprobs/plain {sides['logprobs'][1]:.2f}x"
        )
    print(f"SUMMARY bench_sampler: {device} rows={args.rows}; " + "; ".join(figures) + engine)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
