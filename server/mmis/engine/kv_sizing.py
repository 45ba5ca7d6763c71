"""P1's KV pool size (``--num-kv-blocks`` / ``--kv-cache-gb`` / ``--gpu-memory-utilization``),
resolved once at start-up (the model's dtype: ``engine/dtype.py``).

Invariants:
- The KV pool's size, first that applies: ``--num-kv-blocks``; ``--kv-cache-gb`` (its GiB
  divided by the bytes of one block); ``--gpu-memory-utilization`` on CUDA (the fraction of
  the device's total memory, less what is in use after the weights are loaded, less the
  activation peak of one profiling step at ``max_num_batched_tokens``); else
  :data:`~mmis.engine.config.DEFAULT_KV_BLOCKS`. ``--gpu-memory-utilization`` on a CPU device
  is ignored (logged): ``--kv-cache-gb`` is the CPU way.
- A budget from ``--gpu-memory-utilization`` that holds fewer blocks than one max-length
  sequence needs (``ceil(max_model_len / block_size)`` plus the reserved block 0) raises
  :class:`KVSizingError` naming the flag and both counts; the pool is never smaller.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING

import torch

from mmis.engine.config import EngineConfig

if TYPE_CHECKING:
    from mmis.engine.model import ModelAdapter
    from mmis.engine.runner import ModelRunner
    from mmis.engine.sched_output import SchedulerOutput

log = logging.getLogger("mmis.engine")


class KVSizingError(ValueError):
    """A KV budget that cannot hold one max-length sequence."""


@dataclasses.dataclass(frozen=True)
class KVPlan:
    """How many KV blocks the pool gets, and which setting decided it."""

    num_blocks: int | None  # None: from budget_bytes
    budget_bytes: int | None
    source: str  # the flag that decided, or "default"


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
    from mmis.engine.paged_attention import PagedKVPool
    from mmis.engine.runner import ModelRunner
    from mmis.engine.sched_output import ScheduledRequest, SchedulerOutput

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


def profile_peak_bytes(
    adapter: ModelAdapter,
    *,
    num_tokens: int,
    max_num_seqs: int,
    block_size: int,
    max_model_len: int | None,
) -> int:
    """Bytes the :func:`profile_step` allocates on the adapter's CUDA device beyond what is
    allocated before it (its own KV pool excluded): one real forward, logits and sampling."""
    runner, step = profile_step(
        adapter,
        num_tokens=num_tokens,
        max_num_seqs=max_num_seqs,
        block_size=block_size,
        max_model_len=max_model_len,
    )
    torch.cuda.synchronize(adapter.device)
    torch.cuda.reset_peak_memory_stats(adapter.device)
    before = torch.cuda.memory_allocated(adapter.device)
    runner.execute(step)
    torch.cuda.synchronize(adapter.device)
    peak = torch.cuda.max_memory_allocated(adapter.device) - before
    del runner, step
    torch.cuda.empty_cache()
    return int(max(peak, 0))


def gpu_kv_blocks(
    adapter: ModelAdapter,
    fraction: float,
    *,
    block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int | None,
) -> tuple[int, int]:
    """``(num_blocks, budget_bytes)`` of ``--gpu-memory-utilization fraction`` on the
    adapter's CUDA device, after one profiling step."""
    peak = profile_peak_bytes(
        adapter,
        num_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        block_size=block_size,
        max_model_len=max_model_len,
    )
    free, total = torch.cuda.mem_get_info(adapter.device)
    used = total - free  # weights, CUDA context, other processes
    budget = int(total * fraction) - used - peak
    per_block = adapter.kv_cache_spec(block_size).bytes_per_block
    blocks = blocks_from_budget(
        budget, per_block, max_model_len=max_model_len, block_size=block_size
    )
    log.info(
        "KV sizing: %.2f GiB total x %.2f, %.2f GiB in use, %.2f GiB profiling peak at %d "
        "tokens -> %d blocks of %d bytes",
        total / (1 << 30),
        fraction,
        used / (1 << 30),
        peak / (1 << 30),
        max_num_batched_tokens,
        blocks,
        per_block,
    )
    return blocks, budget


def plan_kv_pool(cfg: EngineConfig, adapter: ModelAdapter, max_model_len: int | None) -> KVPlan:
    """The KV pool's size for ``cfg`` on the adapter's device (the module's precedence)."""
    if cfg.num_kv_blocks is not None:
        return KVPlan(cfg.num_kv_blocks, None, "--num-kv-blocks")
    if cfg.kv_cache_gb is not None:
        return KVPlan(None, cfg.kv_pool_size()[1], "--kv-cache-gb")
    if cfg.gpu_memory_utilization is not None:
        if adapter.device.type == "cuda":
            blocks, budget = gpu_kv_blocks(
                adapter,
                cfg.gpu_memory_utilization,
                block_size=cfg.block_size,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_num_seqs=cfg.max_num_seqs,
                max_model_len=max_model_len,
            )
            return KVPlan(blocks, budget, "--gpu-memory-utilization")
        log.warning(
            "--gpu-memory-utilization applies to CUDA only; on %s use --kv-cache-gb",
            adapter.device.type,
        )
    return KVPlan(cfg.kv_pool_size()[0], None, "default")
