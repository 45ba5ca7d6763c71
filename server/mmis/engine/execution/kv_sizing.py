"""P1's KV pool size (``--num-kv-blocks`` / ``--kv-cache-gb`` / ``--gpu-memory-utilization``),
resolved once at start-up (the model's dtype: ``engine/execution/dtype.py``), and on CUDA the step
size the profile settles on (``engine/batch_limits.py``).

Invariants:
- The KV pool's size, first that applies: ``--num-kv-blocks``; ``--kv-cache-gb`` (its GiB
  divided by the bytes of one block); on CUDA ``--gpu-memory-utilization``, by default
  :data:`~mmis.engine.config.DEFAULT_GPU_MEMORY_UTILIZATION` (the fraction of the device's
  total memory, less what is in use after the weights are loaded, less the CUDA graph pool
  and the activation peak of one profiling step, at most :data:`MAX_SIZED_KV_BLOCKS`
  blocks); else :data:`~mmis.engine.config.DEFAULT_KV_BLOCKS`. ``--gpu-memory-utilization``
  on a CPU device is ignored (logged): ``--kv-cache-gb`` is the CPU way.
- The profiling step is the largest the settings allow (:func:`profile_step`) at the user's
  ``--max-num-batched-tokens``, or at each of ``batch_limits.STEP_TOKEN_CHOICES`` in turn
  until its activations fit (``batch_limits.step_fits``). Under tensor parallelism every rank
  runs it over its own pool of the same size and reads its own device (the one rule:
  ``engine/execution/device_memory.py``); the ranks agree on the minimum
  (``engine/execution/tensor_parallel.py``), so each one's pool fits its device.
- The profiling step is the worst case serving meets (:class:`WorstCase`), all in the one
  step, as the runner would run it (``runner.py``: encoder, forward, sampler, prompt
  logprobs, in that order, the encoder outputs held throughout):
  (1) a maximal encoder batch: ``encoder_sizing.encoder_batch`` copies of the largest image
  item the processor gives (``encoder_sizing.largest_item``), the most encoder tokens the
  scheduler's per-step budget (``--encoder-cache-tokens`` or its probed default) lets one
  step encode; each copy's placeholders end at its sequence's one scheduled token (copies
  back to back, at most ``max_model_len // item`` a sequence, over up to
  ``max_num_seqs - 1`` sequences: a step encodes what its chunks reach);
  (2) the sampler on every sequence with the costliest parameters a request may send
  (:data:`WORST_SAMPLING`: top-k, top-p, min-p, seeded draws, penalties, a logit bias and
  the largest ``logprobs``, ``sampling_params.MAX_LOGPROBS``), grammars excepted (their
  bitmask is ``V / 32`` words a row);
  (3) prompt logprobs (``MAX_PROMPT_LOGPROBS``, always allowed) on every sequence, the
  first one as long as ``max_model_len`` allows (the rest of the step's tokens one token a
  sequence), so its ``N x V`` logits are those of the longest chunk a step may hold.
  The text sequences number ``max_num_seqs`` less the image ones (one more when
  ``--max-num-seqs`` is 1 and there are images).
- The CUDA graph pool (``decode_graphs.py``: captured after sizing, so not "in use" when
  sizing reads the device) is reserved, when graphs will be captured (not
  ``--enforce-eager``, not under tensor parallelism, a ``max_model_len``), as
  ``G`` = the measured peak of the largest bucket's padded static decode step (its buffers
  included; ``DecodeGraphs.run_padded``, what capture records: every bucket shares one pool,
  captured largest first, so the smaller ones reuse its freed blocks) + the other buckets'
  kept outputs (``bucket x hidden`` each) + :data:`GRAPH_SEGMENT_BYTES` per bucket (the
  allocator's segment rounding). The blocks are what is left of the shared room after
  ``max(step peak, G) + G``: the pool holds ``G`` for good, and the eager warm-up of the
  largest bucket needs ``G`` again outside it while capturing.
- Under ``--enable-lora`` the LoRA slots (``--max-loras`` + 1 slots of ``A`` and ``B`` at
  ``--max-lora-rank`` for every wrapped projection, ``engine/lora/manager.py`` ``slot_bytes``,
  allocated after the pool) are reserved like the graph pool, on every rank (each its own
  share), and logged: a ``--gpu-memory-utilization`` pool is that many bytes (rounded up to
  blocks) smaller. ``--num-kv-blocks`` and ``--kv-cache-gb`` are taken as given.
- A budget from ``--gpu-memory-utilization`` that holds fewer blocks than one max-length
  sequence needs (``ceil(max_model_len / block_size)`` plus the reserved block 0) raises
  :class:`KVSizingError` naming the flag and both counts; the pool is never smaller.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mmis.engine.batch_limits import MAX_AUTO_SEQS, step_token_choices
from mmis.engine.config import DEFAULT_GPU_MEMORY_UTILIZATION, EngineConfig
from mmis.engine.execution.device_memory import CudaMemory, DeviceMemory, rank_fit
from mmis.engine.execution.encoder_sizing import ProbedItem, encoder_batch, encoder_cache_tokens
from mmis.engine.scheduling.sampling_params import MAX_LOGPROBS
from mmis.protocol.messages import SamplingParams

if TYPE_CHECKING:
    from mmis.engine.execution.attn_backends import AttentionBackend
    from mmis.engine.execution.model import ModelAdapter
    from mmis.engine.execution.runner import ModelRunner
    from mmis.engine.execution.tensor_parallel import TensorParallel
    from mmis.engine.scheduling.sched_output import SchedulerOutput

# a pool sized from memory holds at most this many blocks: a tiny model on a large GPU would
# otherwise get tens of millions, whose bookkeeping (engine/scheduling/block_pool.py) costs host
# memory
MAX_SIZED_KV_BLOCKS = 1 << 20

log = logging.getLogger("mmis.engine")

# every profiled row's params: the costliest sampler path (sort for top-k/top-p, min-p, seeded
# draws, penalties over the token history, a logit bias) and the largest logprobs and prompt
# logprobs a request may ask (engine/scheduling/request.py: MAX_PROMPT_LOGPROBS = MAX_LOGPROBS)
WORST_SAMPLING = SamplingParams(
    temperature=1.0,
    top_p=0.9,
    top_k=50,
    min_p=0.05,
    seed=0,
    presence_penalty=0.5,
    frequency_penalty=0.5,
    repetition_penalty=1.1,
    logit_bias={0: 1.0},
    logprobs=MAX_LOGPROBS,
    prompt_logprobs=MAX_LOGPROBS,
)
# the CUDA caching allocator's segment granularity (large allocations round up to 2 MiB):
# what a graph pool may hold beyond its measured bytes, per captured bucket
GRAPH_SEGMENT_BYTES = 2 << 20


@dataclasses.dataclass(frozen=True)
class WorstCase:
    """What the profiling step holds besides its text prefill (module docstring): the
    default is the sampler's worst case alone (no images, no graphs)."""

    encoder_item: ProbedItem | None = None  # encoder_sizing.largest_item
    encoder_items: int = 0  # copies of it one step may encode (encoder_sizing.encoder_batch)
    sampling: SamplingParams | None = WORST_SAMPLING  # every row's (None: greedy, nothing else)
    decode_graphs: bool = False  # reserve the CUDA graph pool (captured after sizing)
    attention_backend: str = "auto"  # --attention-backend: the graphs' backend, as the runner's
    lora_bytes: int = 0  # the LoRA slots' buffers, allocated after sizing: reserved


@dataclasses.dataclass(frozen=True)
class _History:
    """A profiled request's token history (penalties and prompt logprobs read it)."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int] = ()


class KVSizingError(ValueError):
    """A KV budget that cannot hold one max-length sequence."""


@dataclasses.dataclass(frozen=True)
class KVPlan:
    """How many KV blocks the pool gets, and which setting decided it."""

    num_blocks: int | None  # None: from budget_bytes
    budget_bytes: int | None
    source: str  # the flag that decided, or "default"
    step_tokens: int | None = None  # the step size the profile settled on (None: no profile)


def min_blocks(max_model_len: int | None, block_size: int) -> int:
    """Blocks one sequence of ``max_model_len`` tokens needs, the reserved block 0 included."""
    return 1 + math.ceil((max_model_len or 1) / block_size)


def blocks_from_budget(
    budget_bytes: int,
    bytes_per_block: int,
    *,
    max_model_len: int | None,
    block_size: int,
    flag: str = "--gpu-memory-utilization",
) -> int:
    """Blocks a byte budget holds; :class:`KVSizingError` when fewer than one max-length
    sequence needs."""
    blocks = max(budget_bytes, 0) // bytes_per_block
    need = min_blocks(max_model_len, block_size)
    if blocks < need:
        raise KVSizingError(
            f"{flag} leaves {max(budget_bytes, 0) / (1 << 30):.3f} GiB for the KV cache: "
            f"{blocks} blocks of {bytes_per_block} bytes, but one sequence of max_model_len "
            f"{max_model_len} tokens needs {need}; raise {flag}, or lower --max-model-len or "
            "--max-num-batched-tokens"
        )
    return blocks


def profile_step(
    adapter: ModelAdapter,
    *,
    num_tokens: int,
    max_num_seqs: int,
    block_size: int,
    max_model_len: int | None,
    worst: WorstCase | None = None,
) -> tuple[ModelRunner, SchedulerOutput]:
    """The largest step the settings allow: ``num_tokens`` tokens over up to ``max_num_seqs``
    sampled sequences of at most ``max_model_len`` tokens, with a runner whose KV pool holds
    exactly them. Without ``worst``: text only, the tokens split evenly; with it, its worst
    case (module docstring; :func:`profile_histories` gives the step's token histories)."""
    from mmis.engine.execution.paged_attention import PagedKVPool
    from mmis.engine.execution.runner import ModelRunner
    from mmis.engine.scheduling.sched_output import (
        MultiModalInput,
        ScheduledRequest,
        SchedulerOutput,
    )

    num_seqs = max(1, min(max_num_seqs, num_tokens))
    images: list[int] = []  # image sequences: copies of the item in each
    if worst is None:
        if max_model_len:
            num_seqs = max(num_seqs, math.ceil(num_tokens / max_model_len))
        lengths = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
        lengths = [n for n in lengths if n > 0]
    else:
        images = _image_sequences(worst, num_tokens, num_seqs, max_model_len)
        lengths = _text_lengths(num_tokens - len(images), num_seqs - len(images), max_model_len)
    item = worst.encoder_item if worst is not None else None
    params = worst.sampling if worst is not None else None
    # (start, tokens, items) per sequence: images first, each chunk its items' last token
    shapes: list[tuple[int, int, int]] = [
        (count * item.tokens - 1, 1, count) for count in images if item is not None
    ]
    shapes += [(0, n, 0) for n in lengths]
    tables, next_block = [], 1
    for start, n, _ in shapes:
        count = math.ceil((start + n) / block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    runner = ModelRunner(adapter, PagedKVPool(adapter.kv_cache_spec(block_size), next_block))
    scheduled, copy = [], 0
    for i, ((start, n, count), table) in enumerate(zip(shapes, tables, strict=True)):
        items = []
        if item is not None:
            for j in range(count):
                offset = j * item.tokens
                items.append(
                    MultiModalInput(f"profile-item-{copy}", offset, item.tokens, item.data)
                )
                copy += 1
        scheduled.append(
            ScheduledRequest(
                f"profile-{i}",
                [0] * n,
                start,
                table,
                mm_items=items,
                sampling_params=params,
                is_new=True,
                encoder_inputs=range(len(items)),
            )
        )
    return runner, SchedulerOutput(scheduled=scheduled)


def _image_sequences(
    worst: WorstCase, num_tokens: int, num_seqs: int, max_model_len: int | None
) -> list[int]:
    """How many copies of the item each image sequence holds (module docstring)."""
    item, copies = worst.encoder_item, worst.encoder_items
    if item is None or copies < 1 or num_tokens < 2:
        return []
    per_seq = (max_model_len or copies * item.tokens) // item.tokens
    if per_seq < 1:  # an item longer than max_model_len is never served
        return []
    seqs = min(math.ceil(copies / per_seq), max(num_seqs - 1, 1), num_tokens - 1)
    copies = min(copies, seqs * per_seq)
    return [copies // seqs + (i < copies % seqs) for i in range(seqs)]


def _text_lengths(num_tokens: int, num_seqs: int, max_model_len: int | None) -> list[int]:
    """Text sequences of ``num_tokens`` in all: the first ones as long as ``max_model_len``
    allows, the rest one token each (more sequences only if ``num_seqs`` cannot hold them)."""
    cap = max_model_len or num_tokens
    lengths = [1] * max(min(num_seqs, num_tokens), 1)
    extra = num_tokens - len(lengths)
    for i in range(len(lengths)):
        add = min(extra, cap - 1)
        lengths[i] += add
        extra -= add
    while extra > 0:
        lengths.append(min(extra, cap))
        extra -= lengths[-1]
    return lengths


def profile_histories(step: SchedulerOutput) -> dict[str, _History]:
    """Every profiled request's history: a prompt one token past its chunk (so every
    scheduled row scores a prompt token), no output yet."""
    return {s.request_id: _History([0] * (s.end_position + 1)) for s in step.scheduled}


def graph_pool_bytes(
    adapter: ModelAdapter,
    backend: AttentionBackend,
    memory: DeviceMemory,
    *,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
) -> int:
    """``G``, the CUDA graph pool the decode graphs will hold (module docstring), measured on
    a scratch pool of one max-length sequence."""
    import torch

    from mmis.engine.execution.decode_graphs import DecodeGraphs, capturable_sizes
    from mmis.engine.execution.paged_attention import PagedKVPool

    pool = PagedKVPool(adapter.kv_cache_spec(block_size), min_blocks(max_model_len, block_size))
    sizes = capturable_sizes(pool, backend, max_num_seqs, max_model_len)
    if not sizes:
        return 0

    def run() -> None:
        graphs = DecodeGraphs(adapter, pool, backend, sizes, max_model_len)
        with torch.inference_mode():
            graphs.run_padded(sizes[-1])

    peak = memory.peak_of(run)
    row = adapter.hidden_size * adapter.dtype.itemsize
    return peak + sum(sizes[:-1]) * row + GRAPH_SEGMENT_BYTES * len(sizes)


def gpu_kv_blocks(
    adapter: ModelAdapter,
    fraction: float,
    *,
    block_size: int,
    max_num_batched_tokens: int | None,
    max_num_seqs: int | None,
    max_model_len: int | None,
    tp: TensorParallel | None = None,
    memory: DeviceMemory | None = None,
    worst: WorstCase | None = None,
) -> tuple[int, int, int]:
    """``(num_blocks, budget_bytes, step_tokens)`` of ``--gpu-memory-utilization fraction`` on
    the adapter's device: the graph pool measured once if ``worst`` reserves it, then one
    profiling step of ``worst`` (default: :class:`WorstCase`'s) per step size
    (``batch_limits``: the user's, or the choices largest first until one fits), mirrored by
    every tensor-parallel rank, whose readings are combined by taking the minimum."""
    from mmis.engine.execution.attn_backends import ProbeShape, select_backend

    memory = memory if memory is not None else CudaMemory(adapter.device)
    worst = worst if worst is not None else WorstCase()
    per_block = adapter.kv_cache_spec(block_size).bytes_per_block
    seqs = max_num_seqs or MAX_AUTO_SEQS
    graphs = 0  # G: the graph pool's bytes
    if worst.decode_graphs and tp is None and max_model_len:
        backend = select_backend(
            adapter.device, block_size, worst.attention_backend, shape=ProbeShape.of(adapter)
        )
        graphs = graph_pool_bytes(
            adapter,
            backend,
            memory,
            block_size=block_size,
            max_num_seqs=seqs,
            max_model_len=max_model_len,
        )
    choices = step_token_choices(max_num_batched_tokens)
    for tokens in choices:
        last = tokens == choices[-1]  # the smallest: taken whatever its activations need
        runner, step = profile_step(
            adapter,
            num_tokens=tokens,
            max_num_seqs=seqs,
            block_size=block_size,
            max_model_len=max_model_len,
            worst=worst,
        )
        histories = profile_histories(step)
        if tp is not None:  # the workers run the same step over a pool of the same size
            tp.begin_profile(runner.pool.num_blocks, fraction, last=last)
            runner.tensor_parallel = tp
        peak = memory.peak_of(
            lambda r=runner, s=step, h=histories: r.execute(s, h)  # type: ignore[misc]
        )
        encoded = sum(len(s.mm_items) for s in step.scheduled)
        del runner, step, histories
        # the graph pool is held for good, and its capture's eager warm-up peaks at G too
        reserved = graphs + worst.lora_bytes
        fit = rank_fit(memory, max(peak, graphs), fraction, per_block, last=last, reserved=reserved)
        fits, blocks = fit.fits, fit.blocks
        if tp is not None:  # every rank takes the same decision: the minimum of the readings
            agreed = tp.agree_min([int(fits), blocks])
            fits, blocks = bool(agreed[0]), agreed[1]
        log.info(
            "KV sizing: %.2f GiB total x %.2f, %.2f GiB in use, %.2f GiB CUDA graph pool, "
            "%.3f GiB LoRA slots, %.2f GiB profiling peak at %d tokens (%d encoder items, "
            "sampler with %s logprobs, prompt logprobs %s) -> %s",
            fit.total / (1 << 30),
            fraction,
            fit.used / (1 << 30),
            graphs / (1 << 30),
            worst.lora_bytes / (1 << 30),
            peak / (1 << 30),
            tokens,
            encoded,
            None if worst.sampling is None else worst.sampling.logprobs,
            None if worst.sampling is None else worst.sampling.prompt_logprobs,
            f"{blocks} blocks of {per_block} bytes" if fits else "activations too large",
        )
        if fits:
            break
    blocks_from_budget(
        blocks * per_block, per_block, max_model_len=max_model_len, block_size=block_size
    )
    if blocks > MAX_SIZED_KV_BLOCKS:
        log.info("KV sizing: %d blocks capped at %d", blocks, MAX_SIZED_KV_BLOCKS)
        blocks = MAX_SIZED_KV_BLOCKS
    return blocks, blocks * per_block, tokens


def lora_slot_bytes(cfg: EngineConfig, adapter: ModelAdapter) -> int:
    """The LoRA slots' bytes on this rank under ``--enable-lora`` (else 0), computed by
    their owner before it allocates them (``engine/lora/manager.py`` ``slot_bytes``)."""
    if not cfg.enable_lora:
        return 0
    from mmis.engine.lora.manager import slot_bytes

    return slot_bytes(
        adapter.model,
        max_loras=cfg.max_loras,
        max_rank=cfg.max_lora_rank,
        shards=adapter.tp_shards,
    )


def worst_case(
    cfg: EngineConfig,
    encoder_item: ProbedItem | None,
    tp: TensorParallel | None,
    adapter: ModelAdapter | None = None,
) -> WorstCase:
    """``mmis engine``'s :class:`WorstCase`: as many copies of ``encoder_item`` as the
    per-step encoder budget takes (the scheduler's: ``builder.make_core``), the worst
    sampler, the graph pool unless ``--enforce-eager`` or tensor parallelism
    (``decode_graphs.setup``), and ``adapter``'s LoRA slots under ``--enable-lora``."""
    copies = 0
    if encoder_item is not None:
        budget = encoder_cache_tokens(cfg.encoder_cache_tokens, encoder_item.tokens)
        copies = encoder_batch(budget, encoder_item.tokens)
    return WorstCase(
        encoder_item=encoder_item,
        encoder_items=copies,
        decode_graphs=not cfg.enforce_eager and tp is None,
        attention_backend=cfg.attention_backend,
        lora_bytes=0 if adapter is None else lora_slot_bytes(cfg, adapter),
    )


def plan_kv_pool(
    cfg: EngineConfig,
    adapter: ModelAdapter,
    max_model_len: int | None,
    tp: TensorParallel | None = None,
    encoder_item: ProbedItem | None = None,
) -> KVPlan:
    """The KV pool's size for ``cfg`` on the adapter's device (the module's precedence);
    ``tp``: rank 0's handle under tensor parallelism (the workers mirror the profile);
    ``encoder_item``: the largest image item (``encoder_sizing.largest_item``; None: the
    profile encodes nothing)."""
    if cfg.num_kv_blocks is not None:
        return KVPlan(cfg.num_kv_blocks, None, "--num-kv-blocks")
    if cfg.kv_cache_gb is not None:
        return KVPlan(None, cfg.kv_pool_size()[1], "--kv-cache-gb")
    if adapter.device.type == "cuda":
        fraction = cfg.gpu_memory_utilization
        source = "--gpu-memory-utilization"
        if fraction is None:
            fraction = DEFAULT_GPU_MEMORY_UTILIZATION
            source = f"{source} {fraction} (default)"
        blocks, budget, tokens = gpu_kv_blocks(
            adapter,
            fraction,
            block_size=cfg.block_size,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=max_model_len,
            tp=tp,
            worst=worst_case(cfg, encoder_item, tp, adapter),
        )
        return KVPlan(blocks, budget, source, tokens)
    if cfg.gpu_memory_utilization is not None:
        log.warning(
            "--gpu-memory-utilization applies to CUDA only; on %s use --kv-cache-gb",
            adapter.device.type,
        )
    return KVPlan(cfg.kv_pool_size()[0], None, "default")
