"""FlexAttention over the paged KV pool, read in place at any block size (issue 44).

:class:`FlexBackend` implements ``attn_backends.AttentionBackend`` with
``torch.nn.attention.flex_attention`` (torch >= 2.11, every release of the supported range:
``torch_support.py``). The pool of one layer, ``[num_blocks, block_size, KVH, D]``, is handed
to the kernel as it lies, viewed as one ``[1, KVH, num_blocks * block_size, D]`` sequence of
*physical* slots; which slots a query reads is said by a block mask whose KV block is one
pool block (``BLOCK_SIZE=(Q_BLOCK, block_size)``):

- ``kv_indices`` (``[B, 1, Q blocks, num_blocks]``): per query block, the pool blocks of its
  sequence's context in logical order, starting at the first block its window reaches;
  ``kv_num_blocks`` how many of them. For decode rows these are split: ``mask_mod`` runs
  only on the partial blocks (the last, and the first when a window starts inside it),
  the ones between are listed as full blocks (``full_kv_indices``), read without a mask.
  The compiled kernel (Triton on CUDA, C++ on CPU) visits
  only those blocks: no byte of the pool is copied, and a decode row reads its own context's
  blocks and nothing else.
- ``mask_mod`` is exact on its own: a physical slot is visible to a query only if its block
  belongs to the query's sequence (``logical[row, block] >= 0``, a ``[B, num_blocks]`` table
  of logical block numbers, -1 elsewhere), and its logical position is causal (or in the
  query's bidirectional span), inside the window and below the sequence's length. So eager
  ``flex_attention`` (which ignores ``kv_indices`` and materialises every score) gives the
  same result, only slowly: a shape the compiler does not take runs correct.

Steps map onto calls like this (per layer):

- **Decode rows** (one token each): one call, batch = the rows padded to a bucket
  (:func:`bucket_rows`, so a compiled kernel is reused), query length 1, GQA native
  (``enable_gqa``). Padding rows have no block (``kv_num_blocks`` 0) and no visible slot.
  Compiled with dynamic shapes (CUDA), torch takes its main kernel for these calls, not
  the split-KV decoding one (that one needs a static batch: ``_use_flex_decoding``): one
  compile for every batch, each (row, head) a program of its own; static decode buckets
  would trade ~13 compiles for split-KV, a choice for a GPU session to measure
  (``benchmarks/bench_flex_blocks.py``). For a static decode step
  (``AttentionMetadata.static``, CUDA graphs) everything is built on the device from the
  bucket's buffers with fixed shapes: no host value enters a shape, no device value reaches
  the host.
- **A chunk on cached context** (``start > 0``): one call per chunk, batch 1, its queries
  padded to a multiple of :data:`Q_BLOCK` (padding queries see nothing), causal from
  ``start``, with its window and bidirectional spans.
- **A fresh prefill** (``start == 0``) never reads the pool: it attends its own new keys
  through ``fresh``, ``attn_backends.TorchBackend.attend_chunk`` (SDPA with the kernel's
  causal flag, or its on-device mask for spans and windows).

Compilation: ``torch.compile(flex_attention)`` once per backend, ``dynamic`` on CUDA (one
kernel for every batch and length), static shapes on CPU (torch's C++ template of
FlexAttention does not compile dynamic shapes: verified on 2.14.1) where the buckets bound
the number of graphs. ``compiled=False`` runs eager (tests of ``mask_mod`` alone). A kernel
that fails to build or run (torch 2.14.1's C++ template also fails to compile a row of 512+
keys in 16-token blocks: a ``CppCompileError``, which is why ``auto`` never picks this
backend on CPU) moves the backend to its ``fallback`` for good, logged once (``broken``).

Invariants:
- The backend never writes the pool and never copies from it; its per-step tensors (tables,
  positions, block masks) are built once per step and window and reused by every layer
  (kept in ``AttentionMetadata.scratch``, which dies with its step).
- Every tensor it builds for a static step has a shape fixed by the bucket and the pool.
- ``logical`` and ``kv_indices`` cost ``2 * 4 * rows * num_blocks`` bytes per step and window.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, cast

import torch

from mmis.engine.execution.attn_metadata import AttentionMetadata, ChunkRows, DecodeRows

log = logging.getLogger(__name__)

Q_BLOCK = 128  # FlexAttention's query block; chunk queries are padded to a multiple of it
RECOMPILE_LIMIT = 64  # graphs of flex_attention one process may compile
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # decode batch padding


def bucket_rows(rows: int) -> int:
    """The padded decode batch for ``rows`` rows (multiples of 128 past the table)."""
    for size in ROW_BUCKETS:
        if size >= rows:
            return size
    return -(-rows // 128) * 128


def _flex() -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def _block_mask(**kw: Any) -> Any:
    from torch.nn.attention.flex_attention import BlockMask

    return BlockMask.from_kv_blocks(compute_q_blocks=False, **kw)


@dataclasses.dataclass
class _Visible:
    """What ``mask_mod`` reads, per batch row ``b`` and query ``q`` (see module docstring)."""

    logical: torch.Tensor  # [B, num_blocks] int32: logical block of each pool block, or -1
    qpos: torch.Tensor  # [B, Q] int64: each query's position (-1: a padding query)
    lo: torch.Tensor  # [B, Q] int64: lowest visible position (the window's start)
    seq_len: torch.Tensor  # [B] int64: keys at or past it do not exist yet
    span_lo: torch.Tensor | None  # [B, Q] int64: the query's bidirectional span, or -1
    span_hi: torch.Tensor | None

    def mask_mod(self, block_size: int) -> Callable[..., torch.Tensor]:
        logical, qpos, lo, seq_len = self.logical, self.qpos, self.lo, self.seq_len
        span_lo, span_hi = self.span_lo, self.span_hi

        def visible(
            b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
        ) -> torch.Tensor:
            block = logical[b, kv // block_size]
            pos = block * block_size + kv % block_size
            seen = pos <= qpos[b, q]
            if span_lo is not None and span_hi is not None:
                seen = seen | ((pos >= span_lo[b, q]) & (pos < span_hi[b, q]))
            return (block >= 0) & seen & (pos >= lo[b, q]) & (pos < seq_len[b])

        return visible


def _logical(table: torch.Tensor, used: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``[B, num_blocks]`` int32: ``j`` at ``table[b, j]`` for ``j < used[b]``, else -1."""
    rows, width = table.shape
    j = torch.arange(width, device=table.device)
    value = torch.where(j[None, :] < used[:, None], j[None, :], -1).to(torch.int32)
    logical = torch.full((rows, num_blocks), -1, dtype=torch.int32, device=table.device)
    # unused columns write -1 too: a later real entry of the same block (never in one row:
    # a sequence's blocks are distinct; the null block 0 pads) is the only conflict, and
    # block 0 is reset below
    logical.scatter_reduce_(1, table.long(), value, reduce="amax")
    logical[:, 0] = -1  # the null block pads every table; it holds no real token
    return logical


def _indices(table: torch.Tensor, first: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``[B, num_blocks]`` int32: row ``b``'s table from column ``first[b]`` on, 0-padded."""
    rows, width = table.shape
    cols = (first[:, None] + torch.arange(width, device=table.device)[None, :]).clamp(max=width - 1)
    out = torch.zeros((rows, num_blocks), dtype=torch.int32, device=table.device)
    out[:, :width] = table.gather(1, cols).to(torch.int32)
    return out


def _once(
    meta: AttentionMetadata, key: object, build: Callable[[], tuple[Any, int]]
) -> tuple[Any, int]:
    """``build()`` once per step and ``key`` (kept in ``meta.scratch``)."""
    if key not in meta.scratch:
        meta.scratch[key] = build()
    mask, padded = cast(tuple[Any, int], meta.scratch[key])
    return mask, padded


class FlexBackend:
    """Paged FlexAttention (see the module docstring)."""

    name = "flex"

    @property
    def reads_in_place(self) -> bool:
        """Whether a step reads the pool without copying it (``decode_graphs``): until the
        kernel fails and the gather fallback takes over."""
        return self.broken is None

    def __init__(
        self,
        block_size: int,
        device: torch.device,
        fallback: Any,
        *,
        compiled: bool = True,
    ) -> None:
        """``fallback``: an ``attn_backends.TorchBackend`` (passed in by
        ``attn_backends.select_backend``: this module does not import that one); fresh
        prefills attend their own keys through its ``attend_chunk``, and every step runs on it
        once the kernel failed (``broken``)."""
        self.block_size = block_size
        self.fallback = fallback
        self.broken: str | None = None  # why the kernel failed once (then: always fallback)
        # the prefill kernel's KV tile must divide the mask's KV block (a pool block): torch
        # 2.14 shrinks its default tile to a smaller power-of-2 block itself, torch 2.11 does
        # not (its decode kernel does), so on CUDA a block below 128 pins the tile to it
        self.chunk_options: dict[str, Any] | None = (
            {"BLOCK_N": block_size} if device.type == "cuda" and block_size < 128 else None
        )
        flex = _flex()
        if compiled:
            # one graph per mask structure and (on CPU) shape; dynamo's default of 8 per code
            # object is shared by every compiled flex_attention of the process
            dynamo = torch._dynamo.config
            dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
        self.flex: Callable[..., Any] = (
            torch.compile(flex, dynamic=device.type == "cuda", fullgraph=True) if compiled else flex
        )

    def attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        new_key: torch.Tensor,
        new_value: torch.Tensor,
        meta: AttentionMetadata,
        scale: float | None,
        window: int | None,
    ) -> torch.Tensor:
        args = (query, key_cache, value_cache, new_key, new_value, meta, scale, window)
        if self.broken is None:
            try:
                return self._attend(*args)
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:  # a kernel that will not build or recompile: fall back
                # (tests/engine/test_flex_backend.py asserts ``broken is None`` where the
                # kernel must run, so a bug in the masks is not hidden by this)
                self.broken = f"{type(exc).__name__}: {str(exc)[:300]}"
                log.warning("flex attention failed (%s); falling back to torch SDPA", self.broken)
        result: torch.Tensor = self.fallback.attend(*args)
        return result

    def _attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        new_key: torch.Tensor,
        new_value: torch.Tensor,
        meta: AttentionMetadata,
        scale: float | None,
        window: int | None,
    ) -> torch.Tensor:
        num_blocks, bs, kv_heads, dim = key_cache.shape
        keys = key_cache.view(1, num_blocks * bs, kv_heads, dim).transpose(1, 2)
        values = value_cache.view(1, num_blocks * bs, kv_heads, dim).transpose(1, 2)
        gqa = query.shape[1] != kv_heads
        rows = meta.decode
        if rows is not None:
            mask, padded = _once(
                meta,
                (self, -1, window),
                lambda: self._decode_mask(rows, num_blocks, window, meta.static),
            )
            # [Bd, H, D]: a decode-only step's query is its rows already (no gather)
            q = query if rows.every_token else query.index_select(0, rows.token_index)
            if padded != rows.num:
                q = torch.cat([q, q.new_zeros((padded - rows.num, *q.shape[1:]))])
            attended = self.flex(
                q.unsqueeze(2), keys, values, block_mask=mask, scale=scale, enable_gqa=gqa
            )[: rows.num, :, 0].to(query.dtype)
            if rows.every_token:
                return attended
            out = torch.empty_like(query)
            out.index_copy_(0, rows.token_index, attended)
        else:
            out = torch.empty_like(query)
        for index, chunk in enumerate(meta.chunks):
            if chunk.start == 0:  # its own new keys only: SDPA, no pool read
                out[chunk.lo : chunk.hi] = self.fallback.attend_chunk(
                    query, key_cache, value_cache, new_key, new_value, chunk, scale, window
                )
                continue
            mask, padded = _once(
                meta,
                (self, index, window),
                lambda c=chunk: self._chunk_mask(c, num_blocks, window),  # type: ignore[misc]
            )
            n = chunk.num_tokens
            q = query[chunk.lo : chunk.hi].transpose(0, 1)  # [H, n, D]
            if padded != n:
                q = torch.cat([q, q.new_zeros((q.shape[0], padded - n, dim))], dim=1)
            attended = self.flex(
                q.unsqueeze(0),
                keys,
                values,
                block_mask=mask,
                scale=scale,
                enable_gqa=gqa,
                kernel_options=self.chunk_options,
            )
            out[chunk.lo : chunk.hi] = attended[0, :, :n].transpose(0, 1).to(out.dtype)
        return out

    def _decode_mask(
        self, rows: DecodeRows, num_blocks: int, window: int | None, static: bool
    ) -> tuple[Any, int]:
        bs = self.block_size
        table, lens = rows.table, rows.seq_lens.long()
        padded = rows.num if static else bucket_rows(rows.num)
        if padded != rows.num:
            extra = padded - rows.num
            table = torch.cat([table, table.new_zeros((extra, table.shape[1]))])
            lens = torch.cat([lens, lens.new_zeros(extra)])
        qpos = lens - 1  # padding rows: -1, nothing visible
        lo = torch.zeros_like(qpos) if window is None else (qpos - window + 1).clamp(min=0)
        first = lo // bs
        last = torch.where(qpos >= 0, qpos // bs, first - 1)
        used = torch.where(qpos >= 0, last + 1, 0)
        visible = _Visible(
            logical=_logical(table, used, num_blocks),
            qpos=qpos[:, None],
            lo=lo[:, None],
            seq_len=lens,
            span_lo=None,
            span_hi=None,
        )
        # mask_mod runs only on the partial blocks: the last (its tail past the context) and
        # the first when the window starts inside it; the blocks between are full (no mask)
        real = qpos >= 0
        cut = real & (lo % bs != 0) & (first < last)
        partial = real.long() + cut.long()
        ends = torch.stack([last.clamp(min=0), first], dim=1)  # [B, 2] table columns
        partial_blocks = torch.zeros((padded, num_blocks), dtype=torch.int32, device=lo.device)
        partial_blocks[:, :2] = table.gather(1, ends).to(torch.int32)
        full_start = first + cut.long()
        full = torch.where(real, last - full_start, 0).clamp(min=0)
        mask = _block_mask(
            kv_num_blocks=partial.to(torch.int32).view(padded, 1, 1),
            kv_indices=partial_blocks.view(padded, 1, 1, num_blocks),
            full_kv_num_blocks=full.to(torch.int32).view(padded, 1, 1),
            full_kv_indices=_indices(table, full_start, num_blocks).view(padded, 1, 1, num_blocks),
            BLOCK_SIZE=(Q_BLOCK, bs),
            mask_mod=visible.mask_mod(bs),
            seq_lengths=(1, num_blocks * bs),
        )
        return mask, padded

    def _chunk_mask(self, chunk: ChunkRows, num_blocks: int, window: int | None) -> tuple[Any, int]:
        bs, device = self.block_size, chunk.block_index.device
        n = chunk.num_tokens
        padded = -(-n // Q_BLOCK) * Q_BLOCK
        q_blocks = padded // Q_BLOCK
        pages = chunk.block_index.long()[None, :]  # [1, m]
        m = pages.shape[1]
        i = torch.arange(padded, device=device)
        qpos = torch.where(i < n, chunk.start + i, -1)
        lo = torch.zeros_like(qpos) if window is None else (qpos - window + 1).clamp(min=0)
        span_lo = span_hi = None
        top = qpos  # the highest position a query sees
        if chunk.spans:
            span_lo = torch.full_like(qpos, -1)
            span_hi = torch.full_like(qpos, -1)
            for a, b in chunk.spans:
                inside = (qpos >= a) & (qpos < b)
                span_lo = torch.where(inside, a, span_lo)
                span_hi = torch.where(inside, b, span_hi)
            top = torch.maximum(qpos, span_hi - 1).clamp(max=chunk.seq_len - 1)
        # per query block: blocks from the lowest query's window start to the highest seen
        real = qpos >= 0
        block_lo = torch.where(real, lo, chunk.seq_len).view(q_blocks, Q_BLOCK).amin(1) // bs
        block_hi = torch.where(real, top, -1).view(q_blocks, Q_BLOCK).amax(1) // bs
        count = torch.where(block_hi >= block_lo, block_hi - block_lo + 1, 0)
        table = pages.expand(q_blocks, m)
        visible = _Visible(
            logical=_logical(pages, torch.full((1,), m, device=device), num_blocks),
            qpos=qpos[None, :],
            lo=lo[None, :],
            seq_len=torch.full((1,), chunk.seq_len, device=device),
            span_lo=None if span_lo is None else span_lo[None, :],
            span_hi=None if span_hi is None else span_hi[None, :],
        )
        mask = _block_mask(
            kv_num_blocks=count.to(torch.int32).view(1, 1, q_blocks),
            kv_indices=_indices(table, block_lo, num_blocks).view(1, 1, q_blocks, num_blocks),
            BLOCK_SIZE=(Q_BLOCK, bs),
            mask_mod=visible.mask_mod(bs),
            seq_lengths=(padded, num_blocks * bs),
        )
        return mask, padded
