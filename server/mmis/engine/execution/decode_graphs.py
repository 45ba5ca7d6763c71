"""Fixed-shape decode steps, replayed as CUDA graphs on CUDA (``--enforce-eager``: never).

A *static decode* step runs the language model over preallocated buffers of one capture size
(a bucket: 1, 2, 4, 8, then multiples of 8 up to ``min(max_num_seqs, 256)``; a batch of ``B``
rows pads up to the smallest bucket that holds it), so every tensor of its forward has a
fixed shape and address and one ``torch.cuda.CUDAGraph`` per bucket replays it. The runner
(``runner.py``) takes it only for a step that :func:`qualifies`; embedding, positions
(``model/adapter.py``: ``[1, B]``, or ``[3, 1, B]`` for M-RoPE, ``model/qwen2_vl.py``) and
sampling stay eager around it, sampling from ``hidden[:B]``.

Invariants:
- A step qualifies when every row is a single token (decode), no row touches a multimodal
  item (nothing to encode or scatter; a bidirectional span never holds such a row's position,
  and decode rows ignore spans in the eager path too, ``attn_metadata.py``), no row pools,
  ``B`` fits the largest bucket and every context fits ``ctx = max_blocks * block_size``
  (``max_blocks = ceil(max_model_len / block_size)``, at most the pool's). Every other step
  (prefill, chunks, images, pooling) runs eager, unchanged.
- Padding rows ``B .. bucket - 1`` have position 0, slot 0 of the null block
  (``block_pool.NULL_BLOCK_ID``, never read for a real token), a block table of zeros and a
  context of 1: they write and read only block 0. Real rows attend keys ``[0, seq_len)``
  through their block tables.
- A static step's metadata (``AttentionMetadata.static``) has no per-step host int in a
  shape: ``ctx`` is fixed and the mask is built on the device from ``seq_lens``, window
  included (``DecodeRows.mask``); ``FlexBackend`` (``flex_backend.py``, CUDA's default)
  builds its block mask on the device from ``seq_lens`` and the tables, so a replayed row
  reads only its real context's blocks, in place, and every bucket is captured;
  ``VarlenBackend`` (``varlen_backend.py``) runs it with its paged kernel (``max_seqlen_k``
  the upper bound ``ctx``) or else on ``TorchBackend``'s gather path, whose per-layer
  gather of one bucket is bounded by :data:`GATHER_BYTES` (larger buckets are not
  captured).
- Graphs are captured on CUDA only, never under tensor parallelism (every rank runs the
  broadcast step eager, ``tensor_parallel.py``): largest bucket first into one shared
  memory pool, each after a warm-up run, under ``torch.inference_mode``; capture writes only
  block 0. Then one padded step through a graph is compared with the eager forward
  (:meth:`DecodeGraphs.verify`); on any exception or mismatch the graphs are dropped and the
  runner stays eager (``setup`` logs why). On CPU nothing is captured: the static path runs
  eager there only for the parity tests (``tests/engine/test_decode_graphs.py``).
- The hidden states a replay returns are a view of the graph's output, overwritten by the
  next replay: the runner reads them before its next step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from mmis.config import GiB
from mmis.engine.execution.attn_backends import AttentionBackend
from mmis.engine.execution.attn_metadata import AttentionMetadata, DecodeRows
from mmis.engine.execution.model.adapter import ModelAdapter
from mmis.engine.execution.paged_attention import PagedKVPool, PagedStep
from mmis.engine.execution.varlen_backend import VarlenBackend
from mmis.engine.scheduling.sched_output import ScheduledRequest

log = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 256
GATHER_BYTES = GiB  # TorchBackend's K + V gather of one layer for the largest bucket
# max |graph - eager| of the eager top token's log-probability (as engine/self_check.py's)
TOLERANCE = {torch.float32: 2e-3, torch.float16: 0.1, torch.bfloat16: 0.2}
NULL_SLOT = 0  # slot 0 of the null block 0 (block_pool.NULL_BLOCK_ID)


class DecodeGraphError(RuntimeError):
    """Capture or its verification failed: decode steps stay eager."""


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The buckets: 1, 2, 4, 8, 16, 24, ... up to the first that holds
    ``min(max_num_seqs, 256)`` rows."""
    cap = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes: list[int] = []
    for b in [1, 2, 4, 8, *range(16, MAX_CAPTURE_SIZE + 1, 8)]:
        sizes.append(b)
        if b >= cap:
            break
    return sizes


def qualifies(seqs: Sequence[ScheduledRequest], max_size: int) -> bool:
    """Whether a step can run as a static decode step (module docstring)."""
    return 0 < len(seqs) <= max_size and all(
        s.num_tokens == 1
        and not s.encoder_inputs
        and s.pooling_params is None
        and not any(it.offset < s.end_position and it.end > s.start_position for it in s.mm_items)
        for s in seqs
    )


def _position_dims(adapter: ModelAdapter, pool: PagedKVPool) -> tuple[int, ...]:
    """The leading dims of the adapter's ``position_ids`` (``(1,)`` or ``(3, 1)``)."""
    probe = [ScheduledRequest("probe", [0], 0, [0])]
    meta = AttentionMetadata.build([1], [0], [[0]], pool.block_size, pool.num_slots, adapter.device)
    return tuple(adapter.step_positions(probe, meta).shape[:-1])


class DecodeGraphs:
    """Static decode buffers of one model and KV pool, and their graphs once captured."""

    def __init__(
        self,
        adapter: ModelAdapter,
        pool: PagedKVPool,
        backend: AttentionBackend,
        sizes: Sequence[int],
        max_model_len: int,
    ) -> None:
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"capture sizes must increase from 1 at least, got {sizes}")
        self.adapter, self.pool, self.backend = adapter, pool, backend
        self.sizes = list(sizes)
        self.max_blocks = min(-(-max_model_len // pool.block_size), pool.num_blocks)
        self.ctx = self.max_blocks * pool.block_size
        n, dev = self.sizes[-1], adapter.device
        self.embeds = torch.zeros(n, adapter.hidden_size, dtype=adapter.dtype, device=dev)
        self.positions = torch.zeros(
            *_position_dims(adapter, pool), n, dtype=torch.long, device=dev
        )
        self.slots = torch.full((n,), NULL_SLOT, dtype=torch.long, device=dev)
        # int32, as the varlen kernels take them (index_select and the mask read them too)
        self.tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.cu_k = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.cu_q = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.rows = torch.arange(n, dtype=torch.long, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_steps = 0  # static steps run (replayed or eager)
        self.last_bucket = 0

    @property
    def max_size(self) -> int:
        return max(self.graphs) if self.graphs else self.sizes[-1]

    def bucket(self, num_rows: int) -> int:
        return next(b for b in self.sizes if b >= num_rows)

    def usable(self, seqs: Sequence[ScheduledRequest], meta: AttentionMetadata) -> bool:
        return meta.max_seq_len <= self.ctx and qualifies(seqs, self.max_size)

    def metadata(self, b: int) -> AttentionMetadata:
        """Bucket ``b``'s metadata: views of the buffers, no shape but ``b`` and ``ctx``."""
        rows = DecodeRows(
            token_index=self.rows[:b],
            block_index=self.tables[:b].view(-1),
            num_blocks=self.max_blocks,
            seq_lens=self.seq_lens[:b],
            ctx=self.ctx,
            uniform=False,  # the mask is always built (on the device, from seq_lens)
            every_token=True,
        )
        return AttentionMetadata(
            block_size=self.pool.block_size,
            block_tables=self.tables[:b],
            seq_lens=self.seq_lens[:b],
            cu_seqlens_q=self.cu_q[: b + 1],
            cu_seqlens_k=self.cu_k[: b + 1],
            max_query_len=1,
            max_seq_len=self.ctx,
            slot_mapping=self.slots[:b],
            positions=self.positions.view(-1, self.positions.shape[-1])[0, :b],
            query_lens_host=np.ones(b, dtype=np.int64),
            starts_host=np.full(b, self.ctx - 1, dtype=np.int64),
            decode=rows,
            chunks=(),
            static=True,
        )

    def _fill(
        self, b: int, embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """Copy a step of ``n <= b`` decode rows (its eager ``meta``) into the buffers."""
        n, width = embeds.shape[0], meta.block_tables.shape[1]
        self.embeds[:n].copy_(embeds)
        self.positions[..., :n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.tables[:n].zero_()
        self.tables[:n, :width].copy_(meta.block_tables)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self._pad(n, b)

    def _pad(self, n: int, b: int) -> None:
        """Rows ``n .. b - 1`` pad: position 0, the null slot, context 1, tables of zeros."""
        self.embeds[n:b].zero_()
        self.positions[..., n:b].zero_()
        self.slots[n:b].fill_(NULL_SLOT)
        self.tables[n:b].zero_()
        self.seq_lens[n:b].fill_(1)
        torch.cumsum(self.seq_lens[:b], 0, dtype=torch.int32, out=self.cu_k[1 : b + 1])

    def _run(self, b: int) -> torch.Tensor:
        step = PagedStep(self.pool, self.metadata(b), self.backend)
        return self.adapter.forward(self.embeds[:b], self.positions[..., :b], step)

    def run_padded(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s static step over padding rows only, eager: what :meth:`capture`
        records for it (KV sizing measures the graph pool with it, ``kv_sizing.py``)."""
        self._pad(0, b)
        return self._run(b)

    def forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The hidden states ``[n, hidden]`` of a qualifying step (its eager ``meta``):
        a graph's replay when one is captured for its bucket, else the static path eager."""
        b = self.bucket(embeds.shape[0])
        self._fill(b, embeds, positions, meta)
        self.num_steps += 1
        self.last_bucket = b
        captured = self.graphs.get(b)
        if captured is None:
            return self._run(b)[: embeds.shape[0]]
        captured[0].replay()
        return captured[1][: embeds.shape[0]]

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket's graph (CUDA), then :meth:`verify`; returns its worst
        difference. Raises :class:`DecodeGraphError` (no graph kept) on any failure."""
        if self.adapter.device.type != "cuda":
            raise DecodeGraphError(f"graphs capture on CUDA only, not {self.adapter.device}")
        try:
            memory = None
            for b in reversed(self.sizes):
                self._pad(0, b)
                self._run(b)  # warm-up: lazy inits and kernel choices happen outside capture
                torch.cuda.synchronize(self.adapter.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=memory):
                    out = self._run(b)
                memory = graph.pool()
                self.graphs[b] = (graph, out)
            torch.cuda.synchronize(self.adapter.device)
            return self.verify()
        except Exception as exc:  # whatever failed, decode stays eager
            self.graphs.clear()
            torch.cuda.empty_cache()
            if isinstance(exc, DecodeGraphError):
                raise
            raise DecodeGraphError(f"{type(exc).__name__}: {exc}") from exc

    @torch.inference_mode()
    def verify(self) -> float:
        """One padded step of up to 3 rows (contexts 1, block_size / 2 + 1, block_size, in
        blocks 1..3: scratch before serving) through :meth:`forward` against the eager
        forward; returns the worst log-probability difference of the eager top token, or
        raises :class:`DecodeGraphError` beyond :data:`TOLERANCE`."""
        adapter, pool, bs = self.adapter, self.pool, self.pool.block_size
        n = min(3, self.max_size, pool.num_blocks - 1)
        if n < 1:
            raise DecodeGraphError("the KV pool has no block besides the null block to check")
        starts = [0, bs // 2, bs - 1][:n]
        seqs = [
            ScheduledRequest(f"graph-check-{i}", [(7 * i + 1) % adapter.vocab_size], s, [1 + i])
            for i, s in enumerate(starts)
        ]
        tables = [list(s.block_table) for s in seqs]
        meta = AttentionMetadata.build([1] * n, starts, tables, bs, pool.num_slots, adapter.device)
        ids = torch.tensor([s.token_ids[0] for s in seqs], device=adapter.device)
        embeds = adapter.embed_tokens(ids)
        positions = adapter.step_positions(seqs, meta)
        eager = adapter.compute_logits(
            adapter.forward(embeds, positions, PagedStep(pool, meta, self.backend))
        )
        got = adapter.compute_logits(self.forward(embeds, positions, meta))
        top = eager.argmax(-1, keepdim=True)
        diff = got.log_softmax(-1).gather(-1, top) - eager.log_softmax(-1).gather(-1, top)
        worst = float(diff.abs().max())
        tolerance = TOLERANCE.get(adapter.dtype, 0.2)
        if not worst <= tolerance:  # NaN fails too
            raise DecodeGraphError(
                f"a padded step of {n} rows differs from eager by {worst:.3g} in a top "
                f"log-probability (tolerance {tolerance:g})"
            )
        return worst


def capturable_sizes(
    pool: PagedKVPool, backend: AttentionBackend, max_num_seqs: int, max_model_len: int
) -> list[int]:
    """:func:`capture_sizes`: all of them (every decode batch up to ``max_num_seqs``) on a
    backend that reads the pool in place (``flex_backend.FlexBackend``; a paged varlen kernel
    in fp16/bf16), each row reading only its real context; otherwise only those whose
    per-layer K + V gather of ``ctx`` keys a row stays within :data:`GATHER_BYTES`."""
    spec, sizes = pool.spec, capture_sizes(max_num_seqs)
    if getattr(backend, "reads_in_place", False):  # flex_backend.FlexBackend, any dtype
        return sizes
    paged = isinstance(backend, VarlenBackend) and backend.paged and backend.broken is None
    if paged and spec.dtype in (torch.float16, torch.bfloat16):
        return sizes
    ctx = min(-(-max_model_len // pool.block_size), pool.num_blocks) * pool.block_size
    row = ctx * spec.bytes_per_block // (spec.num_layers * spec.block_size)  # K + V, a layer
    return [b for b in sizes if b * row <= GATHER_BYTES]


def setup(
    adapter: ModelAdapter,
    pool: PagedKVPool,
    backend: AttentionBackend,
    *,
    enforce_eager: bool,
    max_num_seqs: int,
    max_model_len: int | None,
    tensor_parallel: bool,
) -> DecodeGraphs | None:
    """``mmis engine``'s graphs (captured, verified) or None (eager), logged either way."""
    reason = None
    if max_model_len is None:
        reason = "no maximum model length (set --max-model-len)"
    if adapter.device.type != "cuda":
        reason = f"the device is {adapter.device.type}; only CUDA captures"
    elif enforce_eager:
        reason = "--enforce-eager"
    elif tensor_parallel:
        reason = "tensor parallelism runs every step eager on every rank"
    if reason is not None or max_model_len is None:
        log.info("CUDA graphs: off (%s)", reason)
        return None
    sizes = capturable_sizes(pool, backend, max_num_seqs, max_model_len)
    if not sizes:
        log.info("CUDA graphs: off (one row's context gathers over %d GiB)", GATHER_BYTES // GiB)
        return None
    started = time.perf_counter()
    try:
        graphs = DecodeGraphs(adapter, pool, backend, sizes, max_model_len)
        worst = graphs.capture()
    except Exception as exc:  # any failure (out of memory included): eager, saying why
        log.warning("CUDA graphs: off, capture failed (%s); decode steps run eager", exc)
        return None
    log.info(
        "CUDA graphs: %d decode batch sizes captured in %.1f s (1 to %d rows, %d keys per row, "
        "%s; verified against eager, worst top log-probability difference %.2g)",
        len(graphs.graphs),
        time.perf_counter() - started,
        graphs.max_size,
        graphs.ctx,
        getattr(backend, "name", type(backend).__name__),
        worst,
    )
    return graphs
