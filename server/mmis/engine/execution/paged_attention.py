"""Paged attention for packed variable-length batches, plugged into transformers.

The KV memory is a pool of ``num_blocks`` blocks of ``block_size`` tokens per layer,
preallocated once (``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer, keys and
values: the paged layout FlashAttention reads in place). A sequence's token at position ``p``
lives in slot ``block_table[p // block_size] * block_size + p % block_size``.

:func:`paged_attention_forward` is registered with transformers' ``AttentionInterface`` under
:data:`ATTENTION_NAME`, so the *unmodified* Hugging Face language model calls it from every
attention layer. The step's :class:`PagedStep` travels in the forward kwargs under
:data:`STEP_KWARG`. Per layer it (1) writes the new keys/values in place at the step's slot
mapping and (2) hands the queries to the step's attention backend (``attn_backends.py``),
which reads the context through the block tables of the step's
:class:`~mmis.engine.execution.attn_metadata.AttentionMetadata`. The layer's ``sliding_window`` (as
transformers passes it) is the backend's ``window`` argument.

Invariants:
- All scheduled sequences are packed as batch size 1, in :class:`SchedulerOutput` order.
- Index tensors are built once per step (:meth:`AttentionMetadata.build`), not per layer.
- The function never runs without step metadata: it raises :class:`PagedAttentionError`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from transformers import AttentionInterface

from mmis.engine.execution.attn_backends import AttentionBackend, TorchBackend
from mmis.engine.execution.attn_metadata import AttentionMetadata, PagedAttentionError

ATTENTION_NAME = "mmis_paged"
STEP_KWARG = "mmis_paged_step"
DEFAULT_BLOCK_SIZE = 16

__all__ = [
    "ATTENTION_NAME",
    "DEFAULT_BLOCK_SIZE",
    "STEP_KWARG",
    "AttentionMetadata",
    "KVCacheSpec",
    "PagedAttentionError",
    "PagedAttentionMetadata",
    "PagedKVPool",
    "PagedStep",
    "paged_attention_forward",
    "slots_for",
]


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one model's KV memory."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    block_size: int = DEFAULT_BLOCK_SIZE

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize


class PagedKVPool:
    """Preallocated per-layer key and value blocks."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int) -> None:
        if num_blocks < 1:
            raise PagedAttentionError(f"the KV pool needs at least one block, got {num_blocks}")
        if spec.block_size < 1:
            raise PagedAttentionError(f"block_size must be positive, got {spec.block_size}")
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.key_cache = [
            torch.zeros(shape, dtype=spec.dtype, device=spec.device) for _ in range(spec.num_layers)
        ]
        self.value_cache = [
            torch.zeros(shape, dtype=spec.dtype, device=spec.device) for _ in range(spec.num_layers)
        ]

    @classmethod
    def from_budget(
        cls,
        spec: KVCacheSpec,
        *,
        num_blocks: int | None = None,
        budget_bytes: int | None = None,
    ) -> PagedKVPool:
        """Size the pool from an explicit block count, or else from a byte budget."""
        if num_blocks is None:
            if budget_bytes is None:
                raise PagedAttentionError("give the KV pool a num_blocks or a budget_bytes")
            num_blocks = budget_bytes // spec.bytes_per_block
            if num_blocks < 1:
                raise PagedAttentionError(
                    f"a KV budget of {budget_bytes} bytes holds no block "
                    f"({spec.bytes_per_block} bytes each)"
                )
        return cls(spec, num_blocks)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.spec.block_size

    def flat_keys(self, layer: int) -> torch.Tensor:
        return self.key_cache[layer].view(self.num_slots, self.spec.num_kv_heads, -1)

    def flat_values(self, layer: int) -> torch.Tensor:
        return self.value_cache[layer].view(self.num_slots, self.spec.num_kv_heads, -1)


def slots_for(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Slot ids of positions ``start .. end - 1`` through ``block_table`` (a reference for
    tests and benchmarks; the runner's step uses :class:`AttentionMetadata`)."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


PagedAttentionMetadata = AttentionMetadata  # the name the runner's callers knew


@dataclasses.dataclass(frozen=True)
class PagedStep:
    """What the attention layers receive through the forward kwargs."""

    pool: PagedKVPool
    metadata: AttentionMetadata
    backend: AttentionBackend = dataclasses.field(default_factory=TorchBackend)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query`` [1, H, N, D], ``key``/``value`` [1, KVH, N, D] -> output [1, N, H, D]."""
    step = kwargs.get(STEP_KWARG)
    if not isinstance(step, PagedStep):
        raise PagedAttentionError(
            f"attention {ATTENTION_NAME!r} runs only inside the mmis runner (no {STEP_KWARG})"
        )
    meta, layer = step.metadata, int(getattr(module, "layer_idx", 0))
    if query.shape[0] != 1 or query.shape[2] != meta.num_tokens:
        raise PagedAttentionError(
            f"expected a packed batch of {meta.num_tokens} tokens, got {tuple(query.shape)}"
        )
    key_cache, value_cache = step.pool.key_cache[layer], step.pool.value_cache[layer]
    new_k, new_v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [N, KVH, D]
    flat = (step.pool.num_slots, key_cache.shape[2], key_cache.shape[3])
    key_cache.view(flat).index_copy_(0, meta.slot_mapping, new_k.to(key_cache.dtype))
    value_cache.view(flat).index_copy_(0, meta.slot_mapping, new_v.to(value_cache.dtype))
    window = kwargs.get("sliding_window")
    out = step.backend.attend(
        query[0].transpose(0, 1),  # [N, H, D]
        key_cache,
        value_cache,
        new_k,
        new_v,
        meta,
        scaling,
        int(window) if window else None,
    )
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
