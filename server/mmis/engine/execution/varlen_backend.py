"""The varlen flash-attention backend (CUDA): one varlen flash call per layer for the whole
step (``attn_backends.select_backend`` chooses it only after its probe passes).

:class:`VarlenBackend` reads K/V in place through ``meta.block_tables`` (``seqused_k``),
causal and window as the kernel's own ``window_size``. The kernel is
``flash_attn.flash_attn_varlen_func`` (the optional ``flash-attn`` package,
``pip install 'mmis[cuda]'``) or PyTorch's own ``torch.nn.attention.varlen.varlen_attn``,
called as the installed release's signature allows (:func:`torch_varlen_kernel`: without
``enable_gqa``, torch 2.11, the K/V heads are repeated to the query heads first). Paged reads
need ``block_size % 256 == 0`` (FlashAttention-2's page-size rule), a kernel that takes
``block_table``, and native GQA for a GQA model (else repeating the heads would copy the
whole pool); otherwise the step's context is gathered once per layer into the packed varlen
layout instead (:func:`packed_context_slots`, built once per step without a host sync).
Bidirectional spans are not a flash argument, and flash runs only in fp16/bf16: such steps
fall back to the backend it is given (``attn_backends.TorchBackend``). So does a static decode
step (``meta.static``, ``decode_graphs.py``) without paged reads: the packed gather's length
is a host int; with paged reads it runs as any step, ``max_seqlen_k`` being its upper bound.

Invariants:
- The optional kernels are imported only when :data:`KERNELS` are loaded (CUDA selection); a
  missing or failing import gives ``None`` (the next candidate).
- A kernel that raises in a step (no build for this GPU) falls back to ``TorchBackend`` for
  good, the reason logged once; out-of-memory is re-raised.
- The backend never writes the pool.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

from mmis.engine.execution.attn_metadata import AttentionMetadata

log = logging.getLogger(__name__)

FLASH_PAGE_MULTIPLE = 256  # FlashAttention-2 reads a paged KV only in pages of k * 256

Kernel = Callable[..., torch.Tensor]


@dataclasses.dataclass(frozen=True)
class VarlenKernel:
    """A loaded varlen flash kernel (``run(q, k, v, **VarlenBackend._flash's keywords)``) and
    what its signature takes."""

    name: str
    run: Kernel
    paged_reads: bool = True  # takes block_table + seqused_k: reads the pool in place
    native_gqa: bool = True  # takes fewer K/V heads than query heads (else run repeats them)


KernelLoader = Callable[[], VarlenKernel | None]


def _flash_attn_kernel() -> VarlenKernel | None:
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

    return VarlenKernel("flash-attn", run)


def torch_varlen_kernel(varlen_attn: Callable[..., Any]) -> VarlenKernel:
    """``torch.nn.attention.varlen.varlen_attn`` called as its signature allows:
    ``enable_gqa`` when it has one (torch 2.14; torch 2.11 has none: K/V heads are then
    repeated to the query heads, ``repeat_interleave``, before the call), ``seqused_k`` +
    ``block_table`` when it has them (else no paged reads: the packed gather), ``is_causal``
    when it has one. ``scale`` and ``window_size`` are always passed: a release without them
    fails the probe with its own ``TypeError``."""
    params = inspect.signature(varlen_attn).parameters
    gqa, causal = "enable_gqa" in params, "is_causal" in params
    paged = "block_table" in params and "seqused_k" in params

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        table = kw["block_table"]
        extra: dict[str, Any] = {}
        if gqa:
            extra["enable_gqa"] = q.shape[1] != k.shape[-2]
        elif q.shape[1] != k.shape[-2]:  # head h reads KV head h // rep, as enable_gqa would
            rep = q.shape[1] // k.shape[-2]
            k, v = k.repeat_interleave(rep, dim=-2), v.repeat_interleave(rep, dim=-2)
        if paged:
            extra["seqused_k"] = kw["seqused_k"] if table is not None else None
            extra["block_table"] = table
        if causal:
            extra["is_causal"] = True
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
            **extra,
        )
        return out if isinstance(out, torch.Tensor) else out[0]

    return VarlenKernel("torch-varlen", run, paged_reads=paged, native_gqa=gqa)


def _torch_varlen_kernel() -> VarlenKernel | None:
    try:
        from torch.nn.attention.varlen import varlen_attn

        return torch_varlen_kernel(varlen_attn)
    except Exception as exc:
        log.info("torch.nn.attention.varlen not usable (%s)", exc)
        return None


KERNELS: tuple[KernelLoader, ...] = (_flash_attn_kernel, _torch_varlen_kernel)  # CUDA, in order


class VarlenBackend:
    """One varlen flash-attention call per layer (CUDA; see the module docstring)."""

    def __init__(
        self,
        kernel: Kernel,
        name: str,
        block_size: int,
        fallback: Any,
        *,
        paged_reads: bool = True,
    ) -> None:
        """``fallback``: an ``attn_backends.TorchBackend`` (passed in by
        ``attn_backends.select_backend``: this module does not import that one)."""
        self.kernel = kernel
        self.name = name
        self.block_size = block_size
        self.paged = paged_reads and block_size % FLASH_PAGE_MULTIPLE == 0
        self.fallback = fallback
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

    def run_kernel(
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
        """:meth:`attend` without its fallbacks: the path it takes (paged or packed), what
        the start-up probe runs (``attn_backends.select_backend``)."""
        return self._flash(query, key_cache, value_cache, meta, scale, window)


def packed_context_slots(meta: AttentionMetadata) -> torch.Tensor:
    """``[sum(seq_lens)]`` slot of every context position, sequences concatenated; built
    once per step (kept in ``meta.scratch``) on the device with vectorised ops and no
    device-to-host sync (``output_size`` from the host's lengths); only the CUDA non-paged
    path needs it."""
    cached = meta.scratch.get("packed_context_slots")
    if isinstance(cached, torch.Tensor):
        return cached
    seq_lens = meta.seq_lens.long()
    total = int((meta.starts_host + meta.query_lens_host).sum())  # host ints: no device sync
    row = torch.repeat_interleave(
        torch.arange(meta.num_seqs, device=seq_lens.device), seq_lens, output_size=total
    )
    pos = torch.arange(total, device=seq_lens.device) - meta.cu_seqlens_k[:-1].long()[row]
    block = meta.block_tables.long()[row, pos // meta.block_size]
    slots = block * meta.block_size + pos % meta.block_size
    meta.scratch["packed_context_slots"] = slots  # once per step, not per layer
    return slots
