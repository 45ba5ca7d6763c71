"""P1's KV pool size (``--num-kv-blocks`` / ``--kv-cache-gb`` / ``--gpu-memory-utilization``),
resolved once at start-up (the model's dtype: ``engine/execution/dtype.py``), and on CUDA the step
size the profile settles on (``engine/batch_limits.py``).

Invariants:
- The KV pool's size, first that applies: ``--num-kv-blocks``; ``--kv-cache-gb`` (its GiB
  divided by the bytes of one block); on CUDA ``--gpu-memory-utilization``, by default
  :data:`~mmis.engine.config.DEFAULT_GPU_MEMORY_UTILIZATION` (the fraction of the device's
  total memory, less what is in use after the weights are loaded, less the activation peak of
  one profiling step, at most :data:`MAX_SIZED_KV_BLOCKS` blocks); else
  :data:`~mmis.engine.config.DEFAULT_KV_BLOCKS`. ``--gpu-memory-utilization`` on a CPU device
  is ignored (logged): ``--kv-cache-gb`` is the CPU way.
- The profiling step is the largest the settings allow (:func:`profile_step`) at the user's
  ``--max-num-batched-tokens``, or at each of ``batch_limits.STEP_TOKEN_CHOICES`` in turn
  until its activations fit (``batch_limits.step_fits``). Under tensor parallelism every rank
  runs it over its own pool of the same size and reads its own device (the one rule:
  ``engine/execution/device_memory.py``); the ranks agree on the minimum
  (``engine/execution/tensor_parallel.py``), so each one's pool fits its device.
- A budget from ``--gpu-memory-utilization`` that holds fewer blocks than one max-length
  sequence needs (``ceil(max_model_len / block_size)`` plus the reserved block 0) raises
  :class:`KVSizingError` naming the flag and both counts; the pool is never smaller.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING

from mmis.engine.batch_limits import MAX_AUTO_SEQS, step_token_choices
from mmis.engine.config import DEFAULT_GPU_MEMORY_UTILIZATION, EngineConfig
from mmis.engine.execution.device_memory import CudaMemory, DeviceMemory, rank_fit

if TYPE_CHECKING:
    from mmis.engine.execution.model import ModelAdapter
    from mmis.engine.execution.runner import ModelRunner
    from mmis.engine.execution.tensor_parallel import TensorParallel
    from mmis.engine.scheduling.sched_output import SchedulerOutput

# a pool sized from memory holds at most this many blocks: a tiny model on a large GPU would
# otherwise get tens of millions, whose bookkeeping (engine/scheduling/block_pool.py) costs host
# memory
MAX_SIZED_KV_BLOCKS = 1 << 20

log = logging.getLogger("mmis.engine")


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
) -> tuple[ModelRunner, SchedulerOutput]:
    """The largest step the settings allow: ``num_tokens`` tokens over up to ``max_num_seqs``
    sampled sequences of at most ``max_model_len`` tokens, with a runner whose KV pool holds
    exactly them."""
    from mmis.engine.execution.paged_attention import PagedKVPool
    from mmis.engine.execution.runner import ModelRunner
    from mmis.engine.scheduling.sched_output import ScheduledRequest, SchedulerOutput

    num_seqs = max(1, min(max_num_seqs, num_tokens))
    if max_model_len:
        num_seqs = max(num_seqs, math.ceil(num_tokens / max_model_len))
    lengths = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
    lengths = [n for n in lengths if n > 0]
    tables, next_block = [], 1
    for n in lengths:
        count = math.ceil(n / block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    runner = ModelRunner(adapter, PagedKVPool(adapter.kv_cache_spec(block_size), next_block))
    step = SchedulerOutput(
        scheduled=[
            ScheduledRequest(f"profile-{i}", [0] * n, 0, table)
            for i, (n, table) in enumerate(zip(lengths, tables, strict=True))
        ]
    )
    return runner, step


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
) -> tuple[int, int, int]:
    """``(num_blocks, budget_bytes, step_tokens)`` of ``--gpu-memory-utilization fraction`` on
    the adapter's device: one profiling step per step size (``batch_limits``: the user's, or
    the choices largest first until one fits), mirrored by every tensor-parallel rank, whose
    readings are combined by taking the minimum."""
    memory = memory if memory is not None else CudaMemory(adapter.device)
    per_block = adapter.kv_cache_spec(block_size).bytes_per_block
    choices = step_token_choices(max_num_batched_tokens)
    for tokens in choices:
        last = tokens == choices[-1]  # the smallest: taken whatever its activations need
        runner, step = profile_step(
            adapter,
            num_tokens=tokens,
            max_num_seqs=max_num_seqs or MAX_AUTO_SEQS,
            block_size=block_size,
            max_model_len=max_model_len,
        )
        if tp is not None:  # the workers run the same step over a pool of the same size
            tp.begin_profile(runner.pool.num_blocks, fraction, last=last)
            runner.tensor_parallel = tp
        peak = memory.peak_of(lambda r=runner, s=step: r.execute(s))  # type: ignore[misc]
        del runner, step
        fit = rank_fit(memory, peak, fraction, per_block, last=last)
        fits, blocks = fit.fits, fit.blocks
        if tp is not None:  # every rank takes the same decision: the minimum of the readings
            agreed = tp.agree_min([int(fits), blocks])
            fits, blocks = bool(agreed[0]), agreed[1]
        log.info(
            "KV sizing: %.2f GiB total x %.2f, %.2f GiB in use, %.2f GiB profiling peak at %d "
            "tokens -> %s",
            fit.total / (1 << 30),
            fraction,
            fit.used / (1 << 30),
            fit.peak / (1 << 30),
            tokens,
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


def plan_kv_pool(
    cfg: EngineConfig,
    adapter: ModelAdapter,
    max_model_len: int | None,
    tp: TensorParallel | None = None,
) -> KVPlan:
    """The KV pool's size for ``cfg`` on the adapter's device (the module's precedence);
    ``tp``: rank 0's handle under tensor parallelism (the workers mirror the profile)."""
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
        )
        return KVPlan(blocks, budget, source, tokens)
    if cfg.gpu_memory_utilization is not None:
        log.warning(
            "--gpu-memory-utilization applies to CUDA only; on %s use --kv-cache-gb",
            adapter.device.type,
        )
    return KVPlan(cfg.kv_pool_size()[0], None, "default")
