"""Attention kernels behind one interface: queries of a step attend through the block table.

:class:`AttentionBackend` ``.attend(query, key_cache, value_cache, new_key, new_value, meta,
scale, window)``: ``query`` ``[N, H, D]`` packed rows of the step, ``key_cache`` /
``value_cache`` one layer's pool ``[num_blocks, block_size, KVH, D]`` (this step's keys
already written at ``meta.slot_mapping``), ``new_key`` / ``new_value`` ``[N, KVH, D]`` this
step's keys; returns ``[N, H, D]``. ``window`` is the layer's sliding window (None: full
causal). :func:`select_backend` picks one per device:

- :class:`TorchBackend` (any device, no extra dependency; the CPU path): the decode rows
  attend in batched SDPA calls over their blocks gathered with one ``index_select`` per tensor
  and call (block granularity: ``block_size`` contiguous slots per index), grouped query heads
  folded into query rows, masked only when their lengths differ or a window applies (mask
  built once per step). On CUDA that is one call for all rows. On CPU a call takes as many
  whole rows as keep their gathered K + V within :data:`CPU_GATHER_BYTES`
  (:func:`decode_rows_per_call`), so SDPA reads them from the cache the gather just wrote, and
  every gather writes into buffers kept across calls, layers and steps (:class:`GatherSpace`):
  a fresh gather of more than glibc's largest mmap threshold (32 MiB,
  ``engine/host_memory.py``) is a new mapping each time, its pages faulted in anew. At 32 rows
  x 2k of context, one layer took 78 ms with one gather of all rows, 19 ms in calls within 4
  MiB (``benchmarks/README.md``, "Decode attention in cache-sized calls"). Each ``n > 1``
  chunk gets its own SDPA call: a fresh prefill (start 0) attends its own new keys with the
  kernel's causal flag and never reads the pool, a chunk on cached context gathers its own
  blocks. Chosen by measurement over FlexAttention (``benchmarks/bench_attention.py``,
  README): eager ``flex_attention`` materialises the scores; compiled it needs inductor + a
  C++ compiler at run time and recompiles across step shapes.
- :class:`VarlenBackend` (CUDA): one varlen flash-attention call per layer for the whole
  step, reading K/V in place through ``meta.block_tables`` (``seqused_k``), causal and window
  as the kernel's own ``window_size``. The kernel is ``flash_attn.flash_attn_varlen_func``
  when the optional ``flash-attn`` package is installed (``pip install 'mmis[cuda]'``),
  else PyTorch's own ``torch.nn.attention.varlen.varlen_attn``. Paged reads need
  ``block_size % 256 == 0`` (FlashAttention-2's page-size rule); with another block size the
  step's context is gathered once per layer into the packed varlen layout instead.
  Bidirectional spans are not a flash argument, and flash runs only in fp16/bf16: such steps
  fall back to :class:`TorchBackend`. So does a static decode step (``meta.static``,
  ``decode_graphs.py``) without paged reads: the packed gather's length is a host int; with
  paged reads it runs as any step, ``max_seqlen_k`` being its upper bound.

Invariants:
- A gathered K/V view (:meth:`GatherSpace.gather`) is read only before the next gather into
  its buffer; nothing outside a backend's ``attend`` holds one.
- A backend never writes the pool; :func:`~mmis.engine.paged_attention.paged_attention_forward`
  writes the new keys before calling it.
- Optional kernels are imported lazily, only when a CUDA device is used; a missing or
  failing import, or a kernel that raises on first use (no build for this GPU), falls back
  cleanly to :class:`TorchBackend` (the reason is logged; out-of-memory is re-raised).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from mmis.engine.attn_metadata import AttentionMetadata

log = logging.getLogger(__name__)

FLASH_PAGE_MULTIPLE = 256  # FlashAttention-2 reads a paged KV only in pages of k * 256
CPU_GATHER_BYTES = 4 << 20  # K + V bytes one CPU SDPA call gathers at most (whole rows)


class AttentionBackend(Protocol):
    name: str

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
    ) -> torch.Tensor: ...


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


class GatherSpace:
    """Reused CPU buffers for the K/V blocks one SDPA call reads (see the module docstring)."""

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}

    def gather(self, cache: torch.Tensor, block_index: torch.Tensor, slot: int) -> torch.Tensor:
        """``cache.index_select(0, block_index)``; on CPU written into buffer ``slot`` (0:
        keys, 1: values), valid until the next gather into that slot."""
        if cache.device.type != "cpu":
            return cache.index_select(0, block_index)
        need = int(block_index.shape[0])
        buffer = self._buffers.get(slot)
        if (
            buffer is None
            or buffer.shape[0] < need
            or buffer.shape[1:] != cache.shape[1:]
            or buffer.dtype != cache.dtype
        ):
            buffer = torch.empty((need, *cache.shape[1:]), dtype=cache.dtype)
            self._buffers[slot] = buffer
        return torch.index_select(cache, 0, block_index, out=buffer[:need])


def decode_rows_per_call(rows: int, bytes_per_row: int, device: torch.device) -> int:
    """How many decode rows one SDPA call takes: on CPU as many as keep their gathered K + V
    within :data:`CPU_GATHER_BYTES` (at least one), elsewhere all of them."""
    if device.type != "cpu":
        return rows
    return max(1, min(rows, CPU_GATHER_BYTES // max(1, bytes_per_row)))


class TorchBackend:
    """SDPA over per-step views of the pool (see the module docstring)."""

    name = "torch-sdpa"

    def __init__(self) -> None:
        self.space = GatherSpace()

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
        kv_heads, dim = key_cache.shape[2], key_cache.shape[3]
        gqa = query.shape[1] != kv_heads
        out = torch.empty_like(query)
        rows = meta.decode
        if rows is not None:
            # GQA folded into query rows: the rep query heads of a KV head are rows of one
            # [Bd, KVH, rep, D] query (head h = g * rep + r, as repeat_interleave maps them),
            # 2.5x faster than enable_gqa on CPU at 256 x 2k and no K/V repeat
            q = query.index_select(0, rows.token_index)
            q = q.view(rows.num, kv_heads, query.shape[1] // kv_heads, dim)
            attended = torch.empty_like(q)
            mask = rows.mask(window)
            slots = rows.num_blocks * meta.block_size
            blocks = rows.block_index.view(rows.num, rows.num_blocks)
            per_call = decode_rows_per_call(
                rows.num, 2 * slots * kv_heads * dim * key_cache.element_size(), query.device
            )
            for lo in range(0, rows.num, per_call):
                hi = min(lo + per_call, rows.num)
                index = blocks[lo:hi].reshape(-1)
                # [n, ctx, KVH, D] -> [n, KVH, ctx, D]: views of ONE gather per tensor
                shape = (hi - lo, slots, kv_heads, dim)
                keys = self.space.gather(key_cache, index, 0).view(shape)[:, : rows.ctx]
                values = self.space.gather(value_cache, index, 1).view(shape)[:, : rows.ctx]
                attended[lo:hi] = F.scaled_dot_product_attention(
                    q[lo:hi],
                    _as(keys, q.dtype).transpose(1, 2),
                    _as(values, q.dtype).transpose(1, 2),
                    attn_mask=None if mask is None else mask[lo:hi],
                    scale=scale,
                )
            out.index_copy_(0, rows.token_index, attended.reshape(rows.num, -1, dim))
        for chunk in meta.chunks:
            q = query[chunk.lo : chunk.hi].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if chunk.start == 0:  # everything it attends is this step's own keys
                keys, values = new_key[chunk.lo : chunk.hi], new_value[chunk.lo : chunk.hi]
            else:
                flat = (-1, kv_heads, dim)
                keys = self.space.gather(key_cache, chunk.block_index, 0).view(flat)
                values = self.space.gather(value_cache, chunk.block_index, 1).view(flat)
                keys, values = keys[: chunk.seq_len], values[: chunk.seq_len]
            mask = chunk.mask(window)
            attended = F.scaled_dot_product_attention(
                q,
                _as(keys, q.dtype).transpose(0, 1).unsqueeze(0),
                _as(values, q.dtype).transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=gqa,
            )
            out[chunk.lo : chunk.hi] = attended[0].transpose(0, 1)
        return out


Kernel = Callable[..., torch.Tensor]


def _flash_attn_kernel() -> Kernel | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception as exc:  # any import failure: not usable
        log.info("flash-attn not usable (%s); trying torch's varlen_attn", exc)
        return None

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        left = kw["window"]
        out: torch.Tensor = flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q=kw["cu_seqlens_q"],
            cu_seqlens_k=kw["cu_seqlens_k"],
            max_seqlen_q=kw["max_seqlen_q"],
            max_seqlen_k=kw["max_seqlen_k"],
            softmax_scale=kw["scale"],
            causal=True,
            window_size=(left, 0),
            block_table=kw["block_table"],
        )
        return out

    return run


def _torch_varlen_kernel() -> Kernel | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception as exc:
        log.info("torch.nn.attention.varlen not usable (%s)", exc)
        return None

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        table = kw["block_table"]
        out = varlen_attn(
            q,
            k,
            v,
            kw["cu_seqlens_q"],
            kw["cu_seqlens_k"],
            kw["max_seqlen_q"],
            kw["max_seqlen_k"],
            scale=kw["scale"],
            window_size=(kw["window"], 0),
            enable_gqa=q.shape[1] != k.shape[-2],
            seqused_k=kw["seqused_k"] if table is not None else None,
            block_table=table,
        )
        return out if isinstance(out, torch.Tensor) else out[0]

    return run


class VarlenBackend:
    """One varlen flash-attention call per layer (CUDA; see the module docstring)."""

    def __init__(self, kernel: Kernel, name: str, block_size: int) -> None:
        self.kernel = kernel
        self.name = name
        self.paged = block_size % FLASH_PAGE_MULTIPLE == 0
        self.fallback = TorchBackend()
        self.broken: str | None = None  # why the kernel failed once (then: always fallback)

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
        if (
            self.broken is not None
            or meta.has_spans
            or (meta.static and not self.paged)
            or query.dtype not in (torch.float16, torch.bfloat16)
        ):
            return self.fallback.attend(
                query, key_cache, value_cache, new_key, new_value, meta, scale, window
            )
        try:
            return self._flash(query, key_cache, value_cache, meta, scale, window)
        except (RuntimeError, NotImplementedError) as exc:  # e.g. no kernel for this GPU
            if isinstance(exc, torch.OutOfMemoryError):
                raise
            self.broken = f"{type(exc).__name__}: {exc}"
            log.warning("%s failed (%s); attention falls back to torch SDPA", self.name, exc)
            return self.fallback.attend(
                query, key_cache, value_cache, new_key, new_value, meta, scale, window
            )

    def _flash(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float | None,
        window: int | None,
    ) -> torch.Tensor:
        if self.paged:
            keys, values, table = key_cache, value_cache, meta.block_tables
        else:  # one packed gather of every context, in cu_seqlens_k order
            slots = packed_context_slots(meta)
            flat = (-1, key_cache.shape[2], key_cache.shape[3])
            keys = key_cache.view(flat).index_select(0, slots)
            values = value_cache.view(flat).index_select(0, slots)
            table = None
        return self.kernel(
            query,
            keys,
            values,
            cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            seqused_k=meta.seq_lens,
            block_table=table,
            scale=scale,
            window=-1 if window is None else window - 1,
        )


def packed_context_slots(meta: AttentionMetadata) -> torch.Tensor:
    """``[sum(seq_lens)]`` slot of every context position, sequences concatenated; built
    on the device with vectorised ops (only the CUDA non-paged path needs it)."""
    seq_lens = meta.seq_lens.long()
    total = int((meta.starts_host + meta.query_lens_host).sum())  # host ints: no device sync
    row = torch.repeat_interleave(torch.arange(meta.num_seqs, device=seq_lens.device), seq_lens)
    pos = torch.arange(total, device=seq_lens.device) - meta.cu_seqlens_k[:-1].long()[row]
    block = meta.block_tables.long()[row, pos // meta.block_size]
    return block * meta.block_size + pos % meta.block_size


def select_backend(device: torch.device, block_size: int, name: str = "auto") -> AttentionBackend:
    """``auto``: a varlen flash kernel on CUDA when one imports, else :class:`TorchBackend`;
    ``torch``: always :class:`TorchBackend`."""
    if name not in ("auto", "torch"):
        raise ValueError(f"unknown attention backend {name!r} (auto, torch)")
    if name == "torch" or device.type != "cuda":
        return TorchBackend()
    for kernel_name, factory in (
        ("flash-attn", _flash_attn_kernel),
        ("torch-varlen", _torch_varlen_kernel),
    ):
        kernel = factory()
        if kernel is not None:
            return VarlenBackend(kernel, kernel_name, block_size)
    log.warning("no varlen flash kernel on %s; attention runs on torch SDPA", device)
    return TorchBackend()
