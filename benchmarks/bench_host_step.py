"""Host time per decode step of the engine with a null model (issue 31, the CPU acceptance point).

    .venv/bin/python benchmarks/bench_host_step.py [--sizes 32x1024 256x1024 256x8192 32x8192]
        [--steps 200] [--warmup 30] [--device cpu|cuda] [--threads 1] [--profile 25]
        [--async-scheduling auto|on|off]

The real :class:`EngineCore` (built by ``make_core`` as ``mmis engine`` builds it: scheduler,
KV/prefix cache, encoder cache, runner, sampler, output building) runs the tiny LLaVA
(``mmis-tiny``) whose model work is replaced by constant-time stubs: ``embed_tokens``,
the language-model ``forward`` and ``compute_logits`` return views of buffers preallocated
once (fixed random logits, so greedy picks a fixed token per row), and the vision encoder
(never reached: prompts are text) returns zeros. Everything else per step is the engine's own
code: scheduling, block allocation and prefix-cache registration, the step's attention
metadata, the runner's input tensors, sampling (greedy argmax over the real vocabulary),
``update_from_output`` and the wire outputs.

Per size ``BxC``: ``B`` requests with distinct random prompts of ``C - 15`` to ``C`` tokens (request
``k`` has ``C - k % 16``, so that the rows' block boundaries fall in different steps, as with real
traffic's varied prompts; prefix caching on, no hits) are prefilled (``--max-num-batched-tokens`` a
step, untimed), then every step is a decode step of ``B`` rows; after ``--warmup`` steps,
``--steps`` calls of ``core.step()`` are timed one by one: wall clock (with a stub forward on CPU a
step is all host work) and the thread's CPU time (the same work without the waits a shared machine
adds). The cyclic collector is set up as in the engine process: everything loaded is frozen
(``gc.freeze``, as ``mmis engine`` does after load) and the busy loop's thresholds apply
(``core_process.tune_gc``). The KV pool has as many blocks as the contexts need but a one-float spec
(1 layer, 1 KV head, head dim 1): the stub never reads it, so its bytes would only cost memory.

With ``--async-scheduling on`` a timed ``core.step()`` schedules and launches step N+1, then
collects and updates step N (``engine/core.py``): the same work per call, its rows' input ids
taken from the previous step's sampled ids on the device.

The median is over windows of ``BLOCK_SIZE`` consecutive steps, each window's mean per step
(``per_window``: every row crosses one block boundary in a window, wherever the prefill left
its phase); the plain median of single steps is printed beside it. The last line is
``SUMMARY bench_host_step: ...`` with the wall median (p90 of single steps, CPU-time median)
of every size, the 8k/1k ratios of the wall medians at the same ``B`` and the issue's targets
(judged on the wall medians): 256 running <= 1 ms, 32 running <= 0.3
ms, and 1k vs 8k context within 10% of each other.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import io
import pstats
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tree_compat import add_request, module

from mmis.engine import core_process
from mmis.engine.config import EngineConfig
from mmis.engine.core import EngineCore
from mmis.protocol.messages import EngineCoreRequest, FinishReason, SamplingParams

# imported by name so that an older tree runs this script too (PYTHONPATH=OLD/server)
_model, _pool = (
    module("mmis.engine.execution.model"),
    module("mmis.engine.execution.paged_attention"),
)
ModelAdapter, load_adapter = _model.ModelAdapter, _model.load_adapter
KVCacheSpec, PagedKVPool, PagedStep = _pool.KVCacheSpec, _pool.PagedKVPool, _pool.PagedStep
ModelRunner = module("mmis.engine.execution.runner").ModelRunner
make_core = module("mmis.engine.builder").make_core
tiny_model_dir = module("mmis.tiny_models.tiny_model").tiny_model_dir

TARGET_256_MS = 1.0
TARGET_32_MS = 0.3
TARGET_RATIO = 0.10  # 8k vs 1k context: within 10% of each other
BLOCK_SIZE = 16
ASYNC_SCHEDULING = "auto"  # --async-scheduling (the engine's default: on on CUDA only)


class BenchmarkError(RuntimeError):
    """The engine did not do the work the benchmark asked for."""


class NullModel:
    """Constant-time replacements for the adapter's model work (views of fixed buffers)."""

    def __init__(self, adapter: ModelAdapter, max_rows: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        dev, hidden = adapter.device, adapter.hidden_size
        self.embeds = torch.zeros(max_rows, hidden, dtype=adapter.dtype, device=dev)
        self.hidden = torch.zeros(max_rows, hidden, dtype=adapter.dtype, device=dev)
        logits = torch.randn(max_rows, adapter.vocab_size, generator=gen)
        self.logits = logits.to(dev)
        self.hidden_size = hidden
        self.dtype, self.device = adapter.dtype, dev

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embeds[: token_ids.shape[0]]

    def forward(
        self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, step: PagedStep
    ) -> torch.Tensor:
        return self.hidden[: inputs_embeds.shape[0]]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits[: hidden.shape[0]]

    def encode_images(self, items: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
        raise BenchmarkError("the null-model workload has no images")

    def install(self, adapter: ModelAdapter) -> None:
        for name in ("embed_tokens", "forward", "compute_logits", "encode_images"):
            setattr(adapter, name, getattr(self, name))


def null_runner(adapter: ModelAdapter, num_blocks: int) -> ModelRunner:
    """A runner over a pool of ``num_blocks`` one-float blocks (the stub never reads it)."""
    spec = KVCacheSpec(
        num_layers=1,
        num_kv_heads=1,
        head_dim=1,
        dtype=torch.float32,
        device=adapter.device,
        block_size=BLOCK_SIZE,
    )
    return ModelRunner(adapter, PagedKVPool(spec, num_blocks))


def build_core(
    adapter: ModelAdapter, batch: int, context: int, decode_steps: int, step_tokens: int
) -> EngineCore:
    per_request = -(-(context + decode_steps + 1) // BLOCK_SIZE)
    runner = null_runner(adapter, 1 + batch * per_request + 16)
    cfg = dataclasses.replace(
        EngineConfig(),
        max_num_seqs=batch,
        max_num_batched_tokens=step_tokens,
        block_size=BLOCK_SIZE,
        max_model_len=context + decode_steps + 1,
    )
    if ASYNC_SCHEDULING != "auto":  # only then: an older tree's config has no such field
        cfg = dataclasses.replace(cfg, async_scheduling=ASYNC_SCHEDULING)
    return make_core(cfg, runner)


def add_requests(core: EngineCore, batch: int, context: int, max_tokens: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    vocab = core.vocab_size
    for k in range(batch):  # lengths C - 15 .. C: the rows' block boundaries fall apart
        ids = rng.integers(0, vocab, context - k % BLOCK_SIZE).tolist()
        add_request(
            core,
            EngineCoreRequest(
                request_id=f"host-{k}",
                prompt_token_ids=ids,
                sampling_params=SamplingParams(
                    temperature=0.0, max_tokens=max_tokens, ignore_eos=True
                ),
            ),
        )


def checked_step(core: EngineCore) -> set[str]:
    """One ``core.step()``; returns the requests whose output carried a token (errors raise)."""
    with_token = set()
    for out in core.step():
        if out.finish_reason == FinishReason.ERROR.value:
            message = out.error.message if out.error is not None else "no message"
            raise BenchmarkError(f"request {out.request_id} failed: {message}")
        if out.new_token_ids:
            with_token.add(out.request_id)
    return with_token


class PhaseTimer:
    """Wall time spent in a few of the core's calls during the timed steps (``--breakdown``)."""

    PHASES = (
        ("schedule", "scheduler", "schedule"),
        ("execute", "runner", "execute"),
        ("update", "scheduler", "update_from_output"),
    )

    def __init__(self, core: EngineCore) -> None:
        self.totals = {name: 0 for name, _, _ in self.PHASES}
        self.on = False
        for name, owner, method in self.PHASES:
            target = getattr(core, owner)
            setattr(target, method, self._wrap(name, getattr(target, method)))

    def _wrap(self, name: str, call: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return call(*args, **kwargs)
            t0 = time.perf_counter_ns()
            try:
                return call(*args, **kwargs)
            finally:
                self.totals[name] += time.perf_counter_ns() - t0

        return timed


@dataclasses.dataclass
class Figures:
    batch: int
    context: int
    median_ms: float
    p90_ms: float
    mean_ms: float
    prefill_s: float
    cpu_median_ms: float  # the thread's CPU time: what a shared machine's waits leave out
    step_median_ms: float  # the median of single steps (see ``per_window``)

    @property
    def label(self) -> str:
        return f"{self.batch}x{self.context // 1024}k"


class Workload:
    """One size ``BxC``: its core prefilled and warmed up; :meth:`run` times decode steps."""

    def __init__(
        self,
        adapter: ModelAdapter,
        batch: int,
        context: int,
        *,
        steps: int,
        warmup: int,
        step_tokens: int,
        profile: bool,
        breakdown: bool,
    ) -> None:
        self.batch, self.context = batch, context
        # the first requests decode while the last ones still prefill: room for those tokens
        prefill_steps = -(-batch * context // max(step_tokens - batch, 1)) + batch
        total = prefill_steps + warmup + steps + 2
        self.core = core = build_core(adapter, batch, context, total, step_tokens)
        add_requests(core, batch, context, total, seed=batch * 100_003 + context)
        started = time.perf_counter()
        produced: set[str] = set()
        while len(produced) < batch:  # prefill (chunked), until every request has a token
            produced |= checked_step(core)
        self.prefill_s = time.perf_counter() - started
        for _ in range(warmup):
            if len(checked_step(core)) != batch:
                raise BenchmarkError("a warm-up step was not a decode step of every request")
        self.times: list[int] = []
        self.cpu_times: list[int] = []
        self.profiler = cProfile.Profile() if profile else None
        self.timer = PhaseTimer(core) if breakdown else None

    def run(self, steps: int) -> None:
        core, profiler = self.core, self.profiler
        if self.timer is not None:
            self.timer.on = True
        for _ in range(steps):
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            if profiler is not None:
                profiler.enable()
            outputs = core.step()
            if profiler is not None:
                profiler.disable()
            self.times.append(time.perf_counter_ns() - t0)
            self.cpu_times.append(time.thread_time_ns() - c0)
            if sum(bool(o.new_token_ids) for o in outputs) != self.batch:
                raise BenchmarkError("a timed step was not a decode step of every request")
        if self.timer is not None:
            self.timer.on = False

    def figures(self, profile: int) -> Figures:
        steps = len(self.times)
        if self.timer is not None:
            parts = ", ".join(f"{k} {v / steps / 1e6:.3f}" for k, v in self.timer.totals.items())
            print(f"  {self.batch}x{self.context}: mean ms per step: {parts}", file=sys.stderr)
        if self.profiler is not None:
            text = io.StringIO()
            pstats.Stats(self.profiler, stream=text).sort_stats("tottime").print_stats(profile)
            print(text.getvalue(), file=sys.stderr)
        ms = np.asarray(self.times, dtype=np.float64) / 1e6
        cpu = np.asarray(self.cpu_times, dtype=np.float64) / 1e6
        return Figures(
            self.batch,
            self.context,
            float(np.median(per_window(ms))),
            float(np.percentile(ms, 90)),
            statistics.fmean(ms.tolist()),
            self.prefill_s,
            float(np.median(per_window(cpu))),
            float(np.median(ms)),
        )


def per_window(ms: np.ndarray) -> np.ndarray:
    """Mean ms per step of each run of ``BLOCK_SIZE`` consecutive steps (a trailing part
    dropped). Every row crosses exactly one block boundary in such a run, so each window holds
    the same work whichever steps the crossings fall in, while single steps differ by how many
    rows cross in them (with equal prompt lengths the chunked prefill lined 8 of 32 rows up on
    each of 4 phases at 1k and spread them at 8k: the single-step median then compared a step
    without block work with one that had it)."""
    whole = ms.shape[0] // BLOCK_SIZE * BLOCK_SIZE
    if not whole:
        return ms
    return ms[:whole].reshape(-1, BLOCK_SIZE).mean(axis=1)


def measure_together(
    adapter: ModelAdapter,
    sizes: Sequence[tuple[int, int]],
    *,
    steps: int,
    warmup: int,
    step_tokens: int,
    chunk: int,
    profile: int,
    breakdown: bool = False,
) -> list[Figures]:
    """Time ``sizes`` side by side: all prefilled first, then ``chunk`` steps of each in turn
    (the order rotating every round) until each has ``steps``, so that a shared machine's
    drift from minute to minute weighs on every size alike."""
    loads = [
        Workload(
            adapter,
            batch,
            context,
            steps=steps,
            warmup=warmup,
            step_tokens=step_tokens,
            profile=bool(profile),
            breakdown=breakdown,
        )
        for batch, context in sizes
    ]
    gc.collect()
    done = 0
    while done < steps:
        n = min(chunk, steps - done)
        shift = (done // chunk) % len(loads)
        for load in loads[shift:] + loads[:shift]:
            load.run(n)
        done += n
    return [load.figures(profile) for load in loads]


def parse_size(text: str) -> tuple[int, int]:
    batch, _, context = text.lower().partition("x")
    ctx = int(context[:-1]) * 1024 if context.endswith("k") else int(context)
    return int(batch), ctx


def ratios(figures: list[Figures]) -> list[tuple[int, float]]:
    """Per batch size measured at both 1k and 8k context: median 8k / median 1k."""
    by = {(f.batch, f.context): f for f in figures}
    out = []
    for (batch, context), f in sorted(by.items()):
        short = by.get((batch, 1024))
        if context == 8192 and short is not None:
            out.append((batch, f.median_ms / short.median_ms))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", nargs="+", default=["32x1024", "256x1024", "256x8192", "32x8192"]
    )
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per size")
    parser.add_argument("--warmup", type=int, default=30, help="untimed decode steps first")
    parser.add_argument(
        "--chunk",
        type=int,
        default=BLOCK_SIZE,
        help="steps of one size before the next size's turn",
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, dest="step_tokens")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="cProfile the timed steps: top N"
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="mean time in schedule / execute / update"
    )
    parser.add_argument(
        "--async-scheduling",
        default="auto",
        choices=["auto", "on", "off"],
        help="the engine's --async-scheduling (auto: the engine's default, off on CPU)",
    )
    args = parser.parse_args(argv)
    global ASYNC_SCHEDULING
    ASYNC_SCHEDULING = args.async_scheduling
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    sizes = [parse_size(s) for s in args.sizes]
    torch.set_num_threads(args.threads)
    adapter = load_adapter(tiny_model_dir(), args.device, torch.float32)
    NullModel(adapter, max(args.step_tokens, max(b for b, _ in sizes))).install(adapter)
    # the engine process's collector: libraries and model frozen after load, its busy loop's
    # thresholds (``core_process.tune_gc``; a tree without it keeps CPython's)
    gc.collect()
    gc.freeze()
    getattr(core_process, "tune_gc", lambda: None)()
    print(
        f"null-model engine on {adapter.device}, vocab {adapter.vocab_size}, block size "
        f"{BLOCK_SIZE}, {args.warmup} warm-up + {args.steps} timed decode steps per size"
    )
    print(
        f"{'size':>9} {'median ms':>10} {'p90 ms':>8} {'mean ms':>8} {'cpu median':>11} "
        f"{'step median':>12} {'prefill s':>10}"
    )
    figures = []
    groups: dict[int, list[tuple[int, int]]] = {}
    for batch, context in sizes:  # the sizes of one batch size are timed side by side
        groups.setdefault(batch, []).append((batch, context))
    for group in groups.values():
        for f in measure_together(
            adapter,
            group,
            steps=args.steps,
            warmup=args.warmup,
            step_tokens=args.step_tokens,
            chunk=args.chunk,
            profile=args.profile,
            breakdown=args.breakdown,
        ):
            figures.append(f)
            print(
                f"{f.label:>9} {f.median_ms:>10.3f} {f.p90_ms:>8.3f} {f.mean_ms:>8.3f} "
                f"{f.cpu_median_ms:>11.3f} {f.step_median_ms:>12.3f} {f.prefill_s:>10.1f}",
                flush=True,
            )
    figures.sort(key=lambda f: sizes.index((f.batch, f.context)))
    parts = [
        f"{f.label} {f.median_ms:.3f} ms (p90 {f.p90_ms:.3f}, cpu {f.cpu_median_ms:.3f})"
        for f in figures
    ]
    rs = ratios(figures)
    parts += [f"8k/1k at {b}: {r:.2f}" for b, r in rs]
    verdicts = []
    for f in figures:
        limit = {256: TARGET_256_MS, 32: TARGET_32_MS}.get(f.batch)
        if limit is not None:
            ok = f.median_ms <= limit
            verdicts.append(f"{f.label} <= {limit:g} ms {'met' if ok else 'MISSED'}")
    for b, r in rs:
        ok = abs(r - 1) <= TARGET_RATIO
        verdicts.append(f"8k/1k at {b} within 10% {'met' if ok else 'MISSED'}")
    print(f"SUMMARY bench_host_step: {'; '.join(parts)}; targets: {', '.join(verdicts)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
