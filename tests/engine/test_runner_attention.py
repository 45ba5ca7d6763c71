"""Paged attention alone: packed sequences over a block pool equal per-sequence causal SDPA."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from mmis.engine.paged_attention import (
    STEP_KWARG,
    KVCacheSpec,
    PagedAttentionError,
    PagedAttentionMetadata,
    PagedKVPool,
    PagedStep,
    paged_attention_forward,
    slots_for,
)

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


class _Layer(torch.nn.Module):
    layer_idx = 0


def _spec() -> KVCacheSpec:
    return KVCacheSpec(1, KV_HEADS, DIM, torch.float32, torch.device("cpu"), block_size=BLOCK)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [H, n, D] for positions start..; k, v [KVH, start + n, D] -> [n, H, D]."""
    n, total = q.shape[1], k.shape[1]
    mask = torch.arange(total)[None, :] <= (torch.arange(n)[:, None] + start)
    rep = HEADS // KV_HEADS
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0), attn_mask=mask
    )
    return out.transpose(0, 1)


def test_packed_prefill_and_decode_match_per_sequence_attention():
    gen = torch.Generator().manual_seed(0)
    pool = PagedKVPool(_spec(), num_blocks=32)
    # three sequences: fresh prefill, chunk on top of cached context, single-token decode
    starts, lens = [0, 6, 9], [5, 7, 1]
    free = list(range(32))
    random.Random(0).shuffle(free)  # non-contiguous block tables
    tables = [
        [free.pop() for _ in range((s + n + BLOCK - 1) // BLOCK)]
        for s, n in zip(starts, lens, strict=True)
    ]
    full_k = [
        torch.randn(KV_HEADS, s + n, DIM, generator=gen) for s, n in zip(starts, lens, strict=True)
    ]
    full_v = [
        torch.randn(KV_HEADS, s + n, DIM, generator=gen) for s, n in zip(starts, lens, strict=True)
    ]
    # the cached context was written by earlier steps
    for table, s, k, v in zip(tables, starts, full_k, full_v, strict=True):
        if s:
            slots = torch.tensor(slots_for(table, 0, s, BLOCK))
            pool.flat_keys(0)[slots] = k[:, :s].transpose(0, 1)
            pool.flat_values(0)[slots] = v[:, :s].transpose(0, 1)
    queries = [torch.randn(HEADS, n, DIM, generator=gen) for n in lens]
    meta = PagedAttentionMetadata.build(
        lens, starts, tables, BLOCK, pool.num_slots, torch.device("cpu")
    )
    q = torch.cat(queries, dim=1).unsqueeze(0)
    k = torch.cat([k[:, s:] for k, s in zip(full_k, starts, strict=True)], dim=1).unsqueeze(0)
    v = torch.cat([v[:, s:] for v, s in zip(full_v, starts, strict=True)], dim=1).unsqueeze(0)
    out, _ = paged_attention_forward(_Layer(), q, k, v, None, **{STEP_KWARG: PagedStep(pool, meta)})
    expected = torch.cat(
        [
            _reference(qi, ki, vi, s)
            for qi, ki, vi, s in zip(queries, full_k, full_v, starts, strict=True)
        ]
    )
    torch.testing.assert_close(out[0], expected)
    # the new keys landed in the right slots
    for table, s, n, kk in zip(tables, starts, lens, full_k, strict=True):
        slots = torch.tensor(slots_for(table, s, s + n, BLOCK))
        torch.testing.assert_close(pool.flat_keys(0)[slots], kk[:, s:].transpose(0, 1))


def test_metadata_rejects_inconsistent_steps():
    cpu = torch.device("cpu")
    with pytest.raises(PagedAttentionError, match="cannot hold"):
        PagedAttentionMetadata.build([5], [0], [[0]], BLOCK, 64, cpu)
    with pytest.raises(PagedAttentionError, match="outside the pool"):
        PagedAttentionMetadata.build([2], [0], [[99]], BLOCK, 64, cpu)
    with pytest.raises(PagedAttentionError, match="bad chunk"):
        PagedAttentionMetadata.build([0], [0], [[0]], BLOCK, 64, cpu)


def test_pool_sizing_from_budget():
    spec = _spec()
    assert spec.bytes_per_block == 2 * 1 * BLOCK * KV_HEADS * DIM * 4
    pool = PagedKVPool.from_budget(spec, budget_bytes=10 * spec.bytes_per_block + 5)
    assert pool.num_blocks == 10
    assert tuple(pool.key_cache[0].shape) == (10, BLOCK, KV_HEADS, DIM)
    assert PagedKVPool.from_budget(spec, num_blocks=3, budget_bytes=1).num_blocks == 3
    with pytest.raises(PagedAttentionError, match="holds no block"):
        PagedKVPool.from_budget(spec, budget_bytes=spec.bytes_per_block - 1)
    with pytest.raises(PagedAttentionError, match="num_blocks or a budget"):
        PagedKVPool.from_budget(spec)


def test_attention_without_step_metadata_is_refused():
    q = torch.zeros(1, HEADS, 2, DIM)
    kv = torch.zeros(1, KV_HEADS, 2, DIM)
    with pytest.raises(PagedAttentionError, match="only inside the mmis runner"):
        paged_attention_forward(_Layer(), q, kv, kv, None)
