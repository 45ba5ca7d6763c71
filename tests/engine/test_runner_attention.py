"""Paged attention alone: packed sequences over a block pool equal per-sequence dense SDPA
(causal, sliding window, bidirectional spans), on the CPU backend and, when CUDA is present,
the varlen flash backend."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from mmis.engine.execution import attn_backends
from mmis.engine.execution.attn_backends import TorchBackend, decode_rows_per_call, select_backend
from mmis.engine.execution.paged_attention import (
    STEP_KWARG,
    AttentionMetadata,
    KVCacheSpec,
    PagedAttentionError,
    PagedAttentionMetadata,
    PagedKVPool,
    PagedStep,
    paged_attention_forward,
    slots_for,
)
from mmis.engine.execution.varlen_backend import VarlenBackend, packed_context_slots

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


class _Layer(torch.nn.Module):
    layer_idx = 0


def _spec(device: torch.device | None = None) -> KVCacheSpec:
    return KVCacheSpec(1, KV_HEADS, DIM, torch.float32, device or torch.device("cpu"), BLOCK)


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    window: int | None = None,
    spans: tuple[tuple[int, int], ...] = (),
) -> torch.Tensor:
    """q [H, n, D] for positions start..; k, v [KVH, start + n, D] -> [n, H, D]."""
    n, total = q.shape[1], k.shape[1]
    rows, cols = torch.arange(n)[:, None] + start, torch.arange(total)[None, :]
    mask = cols <= rows
    if window is not None:
        mask &= cols > rows - window
    for lo, hi in spans:
        mask |= (rows >= lo) & (rows < hi) & (cols >= lo) & (cols < hi)
    rep = HEADS // KV_HEADS
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0), attn_mask=mask
    )
    return out.transpose(0, 1)


CASES = {
    "causal": (None, ()),
    "sliding window": (3, ()),
    "bidirectional spans": (None, ((1, 4), (7, 11))),
}


# (device, block size, dtype): the CPU path; on CUDA the varlen flash kernel over a packed
# gather (block size not a multiple of 256) and reading the pool in place (256)
BACKENDS = {
    "torch": ("cpu", BLOCK, torch.float32),
    "cuda-packed": ("cuda", BLOCK, torch.bfloat16),
    "cuda-paged": ("cuda", 256, torch.bfloat16),
}


@pytest.mark.parametrize(
    "backend",
    [pytest.param(b, marks=[pytest.mark.cuda] if "cuda" in b else []) for b in BACKENDS],
)
@pytest.mark.parametrize("case", list(CASES))
def test_packed_prefill_and_decode_match_per_sequence_attention(case, backend):
    window, spans = CASES[case]
    where, block, dtype = BACKENDS[backend]
    device = torch.device(where)
    gen = torch.Generator().manual_seed(0)
    spec = KVCacheSpec(1, KV_HEADS, DIM, dtype, device, block)
    pool = PagedKVPool(spec, num_blocks=32)
    # four sequences: fresh prefill, chunk on top of cached context, two single-token decodes
    # of different lengths
    starts, lens = [0, 6, 9, 3], [5, 7, 1, 1]
    seq_spans = [spans, spans, (), ()]
    free = list(range(1, 32))
    random.Random(0).shuffle(free)  # non-contiguous block tables
    tables = [
        [free.pop() for _ in range((s + n + block - 1) // block)]
        for s, n in zip(starts, lens, strict=True)
    ]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    full_k = [rand(KV_HEADS, s + n, DIM) for s, n in zip(starts, lens, strict=True)]
    full_v = [rand(KV_HEADS, s + n, DIM) for s, n in zip(starts, lens, strict=True)]
    # the cached context was written by earlier steps
    for table, s, k, v in zip(tables, starts, full_k, full_v, strict=True):
        if s:
            slots = torch.tensor(slots_for(table, 0, s, block), device=device)
            pool.flat_keys(0)[slots] = k[:, :s].transpose(0, 1).to(device)
            pool.flat_values(0)[slots] = v[:, :s].transpose(0, 1).to(device)
    queries = [rand(HEADS, n, DIM) for n in lens]
    meta = AttentionMetadata.build(
        lens, starts, tables, block, pool.num_slots, device, bidirectional_spans=seq_spans
    )
    q = torch.cat(queries, dim=1).unsqueeze(0).to(device)
    k = torch.cat([k[:, s:] for k, s in zip(full_k, starts, strict=True)], dim=1).unsqueeze(0)
    v = torch.cat([v[:, s:] for v, s in zip(full_v, starts, strict=True)], dim=1).unsqueeze(0)
    backend = select_backend(device, block)
    if where == "cuda":  # the flash kernel itself, not a silent fallback
        assert isinstance(backend, VarlenBackend) and backend.paged == (block % 256 == 0)
    step = PagedStep(pool, meta, backend)
    kwargs = {STEP_KWARG: step, "sliding_window": window}
    out, _ = paged_attention_forward(_Layer(), q, k.to(device), v.to(device), None, **kwargs)
    expected = torch.cat(
        [
            _reference(qi.float(), ki.float(), vi.float(), s, window, sp)
            for qi, ki, vi, s, sp in zip(queries, full_k, full_v, starts, seq_spans, strict=True)
        ]
    )
    if isinstance(backend, VarlenBackend):
        assert backend.broken is None, backend.broken
    tol = {} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(out[0].float().cpu(), expected, **tol)
    # the new keys landed in the right slots
    for table, s, n, kk in zip(tables, starts, lens, full_k, strict=True):
        slots = torch.tensor(slots_for(table, s, s + n, block), device=device)
        torch.testing.assert_close(pool.flat_keys(0)[slots].cpu(), kk[:, s:].transpose(0, 1))


def _decode_step(
    backend: TorchBackend, lens: list[int], window: int | None, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One all-decode step of ``len(lens)`` rows (contexts ``lens``, query included) over
    shuffled blocks: (the backend's output, per-sequence dense attention)."""
    gen = torch.Generator().manual_seed(seed)
    pool = PagedKVPool(_spec(), num_blocks=64)
    free = list(range(1, 64))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // BLOCK))] for n in lens]
    full_k = [torch.randn(KV_HEADS, n, DIM, generator=gen) for n in lens]
    full_v = [torch.randn(KV_HEADS, n, DIM, generator=gen) for n in lens]
    for table, n, k, v in zip(tables, lens, full_k, full_v, strict=True):
        slots = torch.tensor(slots_for(table, 0, n, BLOCK))
        pool.flat_keys(0)[slots] = k.transpose(0, 1)
        pool.flat_values(0)[slots] = v.transpose(0, 1)
    starts = [n - 1 for n in lens]
    meta = AttentionMetadata.build([1] * len(lens), starts, tables, BLOCK, pool.num_slots, CPU)
    queries = [torch.randn(HEADS, 1, DIM, generator=gen) for _ in lens]
    q = torch.cat(queries, dim=1).transpose(0, 1)  # [N, H, D]
    new_k = pool.flat_keys(0)[meta.slot_mapping]
    new_v = pool.flat_values(0)[meta.slot_mapping]
    got = backend.attend(
        q, pool.key_cache[0], pool.value_cache[0], new_k, new_v, meta, None, window
    )
    want = torch.cat(
        [
            _reference(qi, ki, vi, s, window)
            for qi, ki, vi, s in zip(queries, full_k, full_v, starts, strict=True)
        ]
    )
    return got, want


CPU = torch.device("cpu")


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("rows_per_call", [1, 2, 5])
def test_cpu_decode_rows_attend_in_calls_within_the_gather_budget(
    monkeypatch: pytest.MonkeyPatch, rows_per_call: int, window: int | None
) -> None:
    """On CPU the decode rows attend in calls whose gathered K + V fit
    ``CPU_GATHER_BYTES``, into buffers reused across calls, layers and steps: any split,
    mask or window gives per-sequence attention, and a step after a larger or smaller one
    reads no stale blocks."""
    lens = [9, 2, 13, 5, 7]  # different lengths: masked rows
    row_bytes = 2 * 4 * BLOCK * KV_HEADS * DIM * 4  # 4 blocks of the longest row, K + V
    monkeypatch.setattr(attn_backends, "CPU_GATHER_BYTES", rows_per_call * row_bytes)
    assert decode_rows_per_call(len(lens), row_bytes, CPU) == rows_per_call
    backend = TorchBackend()
    for seed, step_lens in enumerate([lens, lens[:2], [16, 3, 1, 11, 6, 8, 2]]):
        got, want = _decode_step(backend, step_lens, window, seed)
        torch.testing.assert_close(got, want)


def test_decode_rows_per_call_bounds() -> None:
    assert decode_rows_per_call(32, attn_backends.CPU_GATHER_BYTES * 2, CPU) == 1  # one row
    assert decode_rows_per_call(32, 1, CPU) == 32
    assert decode_rows_per_call(32, 1 << 40, torch.device("cuda")) == 32  # one call on GPU


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


def test_backend_selection():
    assert isinstance(select_backend(torch.device("cpu"), BLOCK), TorchBackend)
    assert isinstance(select_backend(torch.device("cuda"), BLOCK, "torch"), TorchBackend)
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend(torch.device("cpu"), BLOCK, "magic")


def _varlen_reference(q, k, v, **kw):  # type: ignore[no-untyped-def]
    """A flash varlen kernel's semantics in plain torch (CPU): causal aligned bottom-right,
    ``window`` keys to the left, K/V packed by ``cu_seqlens_k`` or paged by ``block_table``."""
    cu_q, cu_k, table = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist(), kw["block_table"]
    rows = []
    for i in range(len(cu_q) - 1):
        qi = q[cu_q[i] : cu_q[i + 1]].float()
        n_k = cu_k[i + 1] - cu_k[i]
        if table is None:
            ki, vi = k[cu_k[i] : cu_k[i + 1]], v[cu_k[i] : cu_k[i + 1]]
        else:
            slots = torch.tensor(slots_for(table[i].tolist(), 0, n_k, k.shape[1]))
            ki, vi = k.flatten(0, 1)[slots], v.flatten(0, 1)[slots]
        start = n_k - qi.shape[0]
        rows.append(
            _reference(
                qi.transpose(0, 1),
                ki.float().transpose(0, 1),
                vi.float().transpose(0, 1),
                start,
                None if kw["window"] < 0 else kw["window"] + 1,
            )
        )
    return torch.cat(rows).to(q.dtype)


@pytest.mark.parametrize("block", [BLOCK, 256])
def test_varlen_backend_plumbing_and_fallback_on_cpu(block):  # type: ignore[no-untyped-def]
    """The CUDA backend's arguments, checked on CPU with a reference kernel; and a kernel
    that raises falls back to SDPA for good."""
    gen = torch.Generator().manual_seed(1)
    pool = PagedKVPool(KVCacheSpec(1, KV_HEADS, DIM, torch.bfloat16, torch.device("cpu"), block), 8)
    for cache in (pool.key_cache[0], pool.value_cache[0]):
        cache.copy_(torch.randn(cache.shape, generator=gen).to(torch.bfloat16))
    starts, lens, tables = [0, 2 * block - 3, block + 1], [5, 1, 2], [[3, 5], [6, 1], [2, 7]]
    meta = AttentionMetadata.build(lens, starts, tables, block, pool.num_slots, torch.device("cpu"))
    slots = packed_context_slots(meta).tolist()
    assert slots == [
        x
        for s, n, t in zip(starts, lens, tables, strict=True)
        for x in slots_for(t, 0, s + n, block)
    ]
    q = torch.randn(sum(lens), HEADS, DIM, generator=gen).to(torch.bfloat16)
    new = pool.flat_keys(0)[meta.slot_mapping]  # this step's keys, already in the pool
    new_v = pool.flat_values(0)[meta.slot_mapping]
    args = (q, pool.key_cache[0], pool.value_cache[0], new, new_v, meta, None)
    sdpa = TorchBackend().attend(*args, 2)
    backend = VarlenBackend(_varlen_reference, "reference", block, TorchBackend())
    torch.testing.assert_close(backend.attend(*args, 2), sdpa, atol=2e-2, rtol=2e-2)
    assert backend.broken is None

    def broken(*_: object, **__: object) -> torch.Tensor:
        raise RuntimeError("no kernel image is available for execution on the device")

    backend = VarlenBackend(broken, "broken", block, TorchBackend())
    torch.testing.assert_close(backend.attend(*args, 2), sdpa)
    assert backend.broken is not None and "no kernel image" in backend.broken
