"""Attention kernels behind one interface: queries of a step attend through the block table.

:class:`AttentionBackend` ``.attend(query, key_cache, value_cache, new_key, new_value, meta,
scale, window)``: ``query`` ``[N, H, D]`` packed rows of the step, ``key_cache`` /
``value_cache`` one layer's pool ``[num_blocks, block_size, KVH, D]`` (this step's keys
already written at ``meta.slot_mapping``), ``new_key`` / ``new_value`` ``[N, KVH, D]`` this
step's keys; returns ``[N, H, D]``. ``window`` is the layer's sliding window (None: full
causal). :func:`select_backend` picks one at start-up (below):

- :class:`TorchBackend` (any device, no extra dependency; the CPU path): the decode rows
  attend in batched SDPA calls over their blocks gathered with one ``index_select`` per tensor
  and call (block granularity: ``block_size`` contiguous slots per index), grouped query heads
  folded into query rows, masked only when their lengths differ or a window applies (mask
  built once per step). On CUDA that is one call for all rows. On CPU a call takes as many
  whole rows as keep their gathered K + V within :data:`CPU_GATHER_BYTES`
  (:func:`decode_rows_per_call`), so SDPA reads them from the cache the gather just wrote, and
  every gather writes into buffers kept across calls, layers and steps (:class:`GatherSpace`):
  a fresh gather of more than glibc's largest mmap threshold (32 MiB,
  ``engine/execution/host_memory.py``) is a new mapping each time, its pages faulted in anew. At 32
  rows x 2k of context, one layer took 78 ms with one gather of all rows, 19 ms in calls within 4
  MiB (``benchmarks/README.md``, "Decode attention in cache-sized calls"). Each ``n > 1``
  chunk gets its own SDPA call: a fresh prefill (start 0) attends its own new keys with the
  kernel's causal flag and never reads the pool, a chunk on cached context gathers its own
  blocks. Chosen by measurement over FlexAttention (``benchmarks/bench_attention.py``,
  README): eager ``flex_attention`` materialises the scores; compiled it needs inductor + a
  C++ compiler at run time and recompiles across step shapes.
- ``varlen_backend.VarlenBackend`` (CUDA): one varlen flash-attention call per layer for
  the whole step (flash-attn or torch's ``varlen_attn``), paged reads in place where the
  kernel and the block size allow, else one packed gather per layer.

- ``flex_backend.FlexBackend`` (any device, torch >= 2.11): FlexAttention reading the pool
  in place through a block mask at any block size, decode rows in one call on its decoding
  kernel, windows and bidirectional spans in its ``mask_mod``; the CUDA default of ``auto``.

Selection (:func:`select_backend`; ``runner.py`` calls it with the model's
:class:`ProbeShape` and ``--attention-backend``): the name ``torch`` or a device other than
CUDA is :class:`TorchBackend`; ``flex`` is FlexAttention or a start-up error. On CUDA
``auto`` tries FlexAttention first (its probe: :func:`probe_backend`), then the candidates in
the order of ``varlen_backend.KERNELS`` (flash-attn, then torch's ``varlen_attn``), then
:class:`TorchBackend`. A varlen candidate is
chosen only if it imports AND passes its probe (``_probe_varlen``): the exact call a step makes
(paged or packed, same keywords), run on a tiny step in the model's head size, query and KV
heads (GQA) and dtype, at the pool's block size (page size), without and with a sliding
window, must not raise and must equal :class:`TorchBackend` within
:data:`PROBE_TOLERANCE` (a float32 model fails it uncalled: flash runs in fp16/bf16 only).
So a signature mismatch is a start-up rejection, never a ``TypeError`` in the first step;
the candidates are a parameter, so selection runs on CPU with fake kernels in tests. Every
rejection is logged (warning) with its reason (the exception, or the difference), the choice
at info with paged or packed reads. The start-up self-check (``self_check.py``) then
compares one prompt's logits with transformers on the chosen backend; if that fails on a
varlen backend it switches the runner to :class:`TorchBackend`, logs why, and checks again
(not under tensor parallelism: the other ranks chose their own backends).

Invariants:
- A gathered K/V view (:meth:`GatherSpace.gather`) is read only before the next gather into
  its buffer; nothing outside a backend's ``attend`` holds one.
- A backend never writes the pool;
:func:`~mmis.engine.execution.paged_attention.paged_attention_forward`
  writes the new keys before calling it.
- Optional kernels are imported lazily, only when a CUDA device is used; a missing or
  failing import or a failed probe moves on to the next candidate, and a kernel that still
  raises later (no build for this GPU) falls back to :class:`TorchBackend` for good (each
  reason logged; out-of-memory is re-raised).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from mmis.engine.config import ATTENTION_CHOICES
from mmis.engine.execution import varlen_backend
from mmis.engine.execution.attn_metadata import AttentionMetadata, ChunkRows
from mmis.engine.execution.varlen_backend import KernelLoader

log = logging.getLogger(__name__)

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
        rows = meta.decode
        decoded = None
        if rows is not None:
            # GQA folded into query rows: the rep query heads of a KV head are rows of one
            # [Bd, KVH, rep, D] query (head h = g * rep + r, as repeat_interleave maps them),
            # 2.5x faster than enable_gqa on CPU at 256 x 2k and no K/V repeat; a decode-only
            # step's query is its rows already (no gather, and the result is the output)
            q = query if rows.every_token else query.index_select(0, rows.token_index)
            q = q.view(rows.num, kv_heads, query.shape[1] // kv_heads, dim)
            attended = q.new_empty(q.shape)  # contiguous, whatever q's strides
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
            decoded = attended.view(rows.num, -1, dim)
            if rows.every_token:  # the decode rows are the whole step
                return decoded
        out = torch.empty_like(query)
        if rows is not None and decoded is not None:
            out.index_copy_(0, rows.token_index, decoded)
        for chunk in meta.chunks:
            out[chunk.lo : chunk.hi] = self.attend_chunk(
                query, key_cache, value_cache, new_key, new_value, chunk, scale, window
            )
        return out

    def attend_chunk(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        new_key: torch.Tensor,
        new_value: torch.Tensor,
        chunk: ChunkRows,
        scale: float | None,
        window: int | None,
    ) -> torch.Tensor:
        """``[n, H, D]``: one ``n > 1`` chunk's rows; a fresh prefill (start 0) reads only
        ``new_key`` / ``new_value``, never the pool."""
        kv_heads, dim = key_cache.shape[2], key_cache.shape[3]
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
            enable_gqa=query.shape[1] != kv_heads,
        )
        return attended[0].transpose(0, 1)


@dataclasses.dataclass(frozen=True)
class ProbeShape:
    """The attention a model asks of a kernel: what :func:`probe_backend` runs (the
    default: a GQA bf16 model, for callers that do not say)."""

    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16

    @classmethod
    def of(cls, adapter: Any) -> ProbeShape:
        """A model adapter's (``engine/execution/model/adapter.py``) heads, head size and dtype."""
        return cls(adapter.num_heads, adapter.num_kv_heads, adapter.head_dim, adapter.dtype)


PROBE_WINDOW = 3  # the probe's sliding window (keys)
PROBE_SCALE = 2.0  # x 1/sqrt(head_dim), the kernels' default scale: ignoring scale fails
# max |kernel - torch SDPA| of the probe's outputs, by dtype (flash runs in these only)
PROBE_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 5e-2}
FLEX_TOLERANCE = {**PROBE_TOLERANCE, torch.float32: 1e-4}  # FlexAttention runs fp32 too


def probe_backend(
    run: Callable[..., torch.Tensor],
    block_size: int,
    shape: ProbeShape,
    device: torch.device,
    tolerance: float,
) -> str | None:
    """Why ``run`` (an ``AttentionBackend.attend``) cannot serve ``shape`` on ``device``
    (None: it can). Runs it once without and once with a sliding window, on a tiny step in
    ``shape``'s heads, head size and dtype over shuffled blocks of ``block_size`` (a fresh
    prefill, a chunk on cached context across a block boundary, two decode rows of different
    lengths), and compares with :class:`TorchBackend`: an exception (but out-of-memory) or a
    difference over ``tolerance`` is the reason."""
    bs, gen = block_size, torch.Generator().manual_seed(0)
    scale = PROBE_SCALE / shape.head_dim**0.5
    starts, lens = [0, bs - 1, 2 * bs - 1, 2], [5, 3, 1, 1]
    needed = [-(-(s + n) // bs) for s, n in zip(starts, lens, strict=True)]
    free = (torch.randperm(sum(needed), generator=gen) + 1).tolist()  # block 0: null
    tables = [[free.pop() for _ in range(n)] for n in needed]
    pool_shape = (sum(needed) + 1, bs, shape.num_kv_heads, shape.head_dim)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen).to(device=device, dtype=shape.dtype)

    key_cache, value_cache = rand(*pool_shape), rand(*pool_shape)
    meta = AttentionMetadata.build(lens, starts, tables, bs, pool_shape[0] * bs, device)
    query = rand(meta.num_tokens, shape.num_heads, shape.head_dim)
    flat = (-1, shape.num_kv_heads, shape.head_dim)
    new_key = key_cache.view(flat)[meta.slot_mapping]
    new_value = value_cache.view(flat)[meta.slot_mapping]
    for window in (None, PROBE_WINDOW):
        with torch.inference_mode():
            want = TorchBackend().attend(
                query, key_cache, value_cache, new_key, new_value, meta, scale, window
            )
            try:
                got = run(query, key_cache, value_cache, new_key, new_value, meta, scale, window)
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:  # any failure (TypeError included): not usable
                return f"{type(exc).__name__}: {exc}"
        if got.shape != want.shape:
            return f"it returned shape {tuple(got.shape)}, not {tuple(want.shape)}"
        worst = float((got.float() - want.float()).abs().max())
        if not worst <= tolerance:  # NaN fails too
            return (
                f"its output differs from torch SDPA by {worst:.3g} (window {window}, "
                f"tolerance {tolerance:g})"
            )
    return None


def _probe_varlen(
    backend: varlen_backend.VarlenBackend, shape: ProbeShape, device: torch.device
) -> str | None:
    """Why a varlen kernel cannot serve ``shape`` on ``device`` (None: it can): the path
    its ``attend`` takes (paged or packed) through :func:`probe_backend`."""
    tolerance = PROBE_TOLERANCE.get(shape.dtype)
    if tolerance is None:
        return f"flash kernels run in float16/bfloat16 only; the model is {shape.dtype}"
    return probe_backend(backend.run_kernel, backend.block_size, shape, device, tolerance)


class AttentionBackendError(RuntimeError):
    """The attention backend asked for by name cannot run here (its probe's reason)."""


def _flex_backend(
    block_size: int, device: torch.device, shape: ProbeShape, compiled: bool
) -> tuple[AttentionBackend | None, str]:
    try:
        from mmis.engine.execution.flex_backend import FlexBackend

        backend = FlexBackend(block_size, device, TorchBackend(), compiled=compiled)
    except Exception as exc:  # no flex_attention in this torch, no compiler: not usable
        return None, f"{type(exc).__name__}: {exc}"
    tolerance = FLEX_TOLERANCE.get(shape.dtype, FLEX_TOLERANCE[torch.float32])
    reason = probe_backend(backend.attend, block_size, shape, device, tolerance)
    return (backend, "") if reason is None else (None, reason)


def select_backend(
    device: torch.device,
    block_size: int,
    name: str = "auto",
    *,
    shape: ProbeShape | None = None,
    kernels: Sequence[KernelLoader] | None = None,
    compiled: bool = True,
) -> AttentionBackend:
    """The step's attention (each rejection logged with its reason, the choice at info):

    - ``torch``: :class:`TorchBackend`.
    - ``flex``: ``flex_backend.FlexBackend`` (``compiled``: through ``torch.compile``) if it
      passes :func:`probe_backend` for ``shape`` (default :class:`ProbeShape`), else
      :class:`AttentionBackendError` with the reason.
    - ``auto`` on CUDA (``kernels`` not given): FlexAttention as above (paged reads in place
      at any block size), else the first of ``varlen_backend.KERNELS`` that loads and passes
      its probe (``_probe_varlen``), else :class:`TorchBackend`. ``auto`` with ``kernels``
      (tests: fake kernels on CPU) tries only those. ``auto`` on another device:
      :class:`TorchBackend` (measured faster on CPU than eager or compiled FlexAttention,
      ``benchmarks/README.md``).
    """
    if name not in ATTENTION_CHOICES:
        raise ValueError(f"unknown attention backend {name!r} ({', '.join(ATTENTION_CHOICES)})")
    if name == "torch":
        log.info("attention: torch-sdpa (asked for by name)")
        return TorchBackend()
    shape = shape or ProbeShape()
    if name == "flex" or (kernels is None and device.type == "cuda"):
        flex, reason = _flex_backend(block_size, device, shape, compiled)
        if flex is not None:
            log.info("attention: flex (paged reads in place, block size %d)", block_size)
            return flex
        if name == "flex":
            raise AttentionBackendError(f"the flex attention backend cannot run: {reason}")
        log.warning("attention: flex failed the start-up probe (%s)", reason)
    if kernels is None and device.type != "cuda":
        log.info("attention: torch-sdpa (the %s path)", device.type)
        return TorchBackend()
    for load in varlen_backend.KERNELS if kernels is None else kernels:
        kernel = load()
        if kernel is None:
            continue
        grouped = shape.num_heads != shape.num_kv_heads
        paged_reads = kernel.paged_reads and (kernel.native_gqa or not grouped)
        backend = varlen_backend.VarlenBackend(
            kernel.run, kernel.name, block_size, TorchBackend(), paged_reads=paged_reads
        )
        why = _probe_varlen(backend, shape, device)
        if why is None:
            log.info(
                "attention: %s (%s reads, block size %d)",
                kernel.name,
                "paged" if backend.paged else "packed",
                block_size,
            )
            return backend
        log.warning("attention: %s failed the start-up probe (%s)", kernel.name, why)
    log.warning("attention: no paged or varlen kernel usable on %s; torch SDPA", device)
    return TorchBackend()
