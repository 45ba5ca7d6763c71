"""Paged attention for packed variable-length batches, plugged into transformers.

The KV memory is a pool of ``num_blocks`` blocks of ``block_size`` tokens per layer,
preallocated once (``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer, keys and
values). A sequence's token at position ``p`` lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

:func:`paged_attention_forward` is registered with transformers' ``AttentionInterface`` under
:data:`ATTENTION_NAME`, so the *unmodified* Hugging Face language model calls it from every
attention layer. The step's :class:`PagedStep` travels in the forward kwargs under
:data:`STEP_KWARG`. Per layer it (1) writes the new keys/values at the step's slot mapping and
(2) attends each sequence's new queries over that sequence's whole context, gathered through
its block table: causal inside the new tokens, full over the cached ones. GQA is handled by
SDPA's ``enable_gqa``.

Invariants:
- All scheduled sequences are packed as batch size 1, in :class:`SchedulerOutput` order.
- Index tensors are built once per step (:meth:`PagedAttentionMetadata.build`), not per layer.
- Decode rows of a step share one SDPA call; each longer chunk gets its own (no padding of a
  long prefill to the batch size).
- The function never runs without step metadata: it raises :class:`PagedAttentionError`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "mmis_paged"
STEP_KWARG = "mmis_paged_step"
DEFAULT_BLOCK_SIZE = 16


class PagedAttentionError(ValueError):
    """Inconsistent KV pool sizing or step metadata."""


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
    """Slot ids of positions ``start .. end - 1`` through ``block_table``."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


@dataclasses.dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended in one SDPA call, padded to ``Q`` query rows and ``C`` context slots.

    Decode rows (one new token each) share one group; every longer chunk gets its own, so
    padding never multiplies a long prefill by the batch size.
    """

    token_index: torch.Tensor  # [T] packed index of each valid query row, row-major order
    query_index: torch.Tensor  # [G, Q] packed index of each (sequence, query row); pads -> 0
    query_valid: torch.Tensor  # [G, Q] bool
    context_slots: torch.Tensor  # [G, C] slot of each context position; pads -> 0
    mask: torch.Tensor  # [G, 1, Q, C] bool, True = attend

    @classmethod
    def build(
        cls,
        members: Sequence[tuple[int, int, int, list[int]]],  # (packed offset, n, start, slots)
        device: torch.device,
    ) -> AttentionGroup:
        size, max_q = len(members), max(m[1] for m in members)
        max_c = max(len(m[3]) for m in members)
        query_index = torch.zeros(size, max_q, dtype=torch.long)
        query_valid = torch.zeros(size, max_q, dtype=torch.bool)
        context = torch.zeros(size, max_c, dtype=torch.long)
        mask = torch.zeros(size, 1, max_q, max_c, dtype=torch.bool)
        for i, (offset, n, start, slots) in enumerate(members):
            query_index[i, :n] = torch.arange(offset, offset + n)
            query_valid[i, :n] = True
            context[i, : start + n] = torch.tensor(slots, dtype=torch.long)
            rows = torch.arange(n).unsqueeze(1) + start  # absolute position of each query
            mask[i, 0, :n, : start + n] = torch.arange(start + n).unsqueeze(0) <= rows
            mask[i, 0, n:, 0] = True  # padded rows attend somewhere, so SDPA yields no NaN
        return cls(
            token_index=query_index[query_valid].to(device),
            query_index=query_index.to(device),
            query_valid=query_valid.to(device),
            context_slots=context.to(device),
            mask=mask.to(device),
        )


@dataclasses.dataclass(frozen=True)
class PagedAttentionMetadata:
    """Per-step index tensors shared by every layer (``N`` packed new tokens)."""

    slot_mapping: torch.Tensor  # [N] slot of each new token
    groups: tuple[AttentionGroup, ...]

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        start_positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        num_slots: int,
        device: torch.device,
    ) -> PagedAttentionMetadata:
        if not (len(query_lens) == len(start_positions) == len(block_tables)) or not query_lens:
            raise PagedAttentionError("a step needs one query length, start and block table each")
        new_slots: list[int] = []
        decodes: list[tuple[int, int, int, list[int]]] = []
        chunks: list[tuple[int, int, int, list[int]]] = []
        offset = 0
        for n, start, table in zip(query_lens, start_positions, block_tables, strict=True):
            if n < 1 or start < 0:
                raise PagedAttentionError(f"bad chunk: {n} tokens at start {start}")
            if len(table) * block_size < start + n:
                raise PagedAttentionError(
                    f"block table of {len(table)} blocks cannot hold {start + n} tokens"
                )
            if table and (min(table) < 0 or (max(table) + 1) * block_size > num_slots):
                raise PagedAttentionError(
                    f"a block table points outside the pool ({num_slots} slots)"
                )
            slots = slots_for(table, 0, start + n, block_size)
            new_slots.extend(slots[start:])
            (decodes if n == 1 else chunks).append((offset, n, start, slots))
            offset += n
        groups = [AttentionGroup.build([c], device) for c in chunks]
        if decodes:
            groups.append(AttentionGroup.build(decodes, device))
        return cls(
            slot_mapping=torch.tensor(new_slots, dtype=torch.long, device=device),
            groups=tuple(groups),
        )

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


@dataclasses.dataclass(frozen=True)
class PagedStep:
    """What the attention layers receive through the forward kwargs."""

    pool: PagedKVPool
    metadata: PagedAttentionMetadata


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
    keys, values = step.pool.flat_keys(layer), step.pool.flat_values(layer)
    keys.index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1).to(keys.dtype))
    values.index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1).to(values.dtype))
    packed_q = query[0].transpose(0, 1)  # [N, H, D]
    out = torch.empty_like(packed_q)
    for group in meta.groups:
        # [G, C, KVH, D] -> [G, KVH, C, D];  [G, Q, H, D] -> [G, H, Q, D]
        ctx_k = keys[group.context_slots].transpose(1, 2).to(query.dtype)
        ctx_v = values[group.context_slots].transpose(1, 2).to(query.dtype)
        q = packed_q[group.query_index].transpose(1, 2)
        attended = F.scaled_dot_product_attention(
            q,
            ctx_k,
            ctx_v,
            attn_mask=group.mask,
            scale=scaling,
            enable_gqa=q.shape[1] != ctx_k.shape[1],
        )
        out[group.token_index] = attended.transpose(1, 2)[group.query_valid]
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
