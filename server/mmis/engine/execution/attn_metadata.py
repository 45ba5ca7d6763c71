"""Per-step attention metadata: built once per step as tensors, read by every layer.

A step packs ``B`` sequences (``N`` new tokens in all, batch size 1) in
:class:`~mmis.engine.scheduling.sched_output.SchedulerOutput` order. Sequence ``i`` has ``start[i]``
tokens in the KV pool already and computes ``query_len[i]`` new ones, so its context after the
step is ``seq_len[i] = start[i] + query_len[i]``. :meth:`AttentionMetadata.build` turns the
step into:

- ``block_tables`` ``[B, max_blocks]`` int32: each sequence's blocks covering its context,
  padded with the null block 0 (``block_pool.NULL_BLOCK_ID``; never read for a real token);
- ``cu_seqlens_q`` / ``cu_seqlens_k`` ``[B + 1]`` int32 and ``seq_lens`` ``[B]`` int32, the
  varlen kernels' arguments; ``max_query_len`` / ``max_seq_len`` as ints;
- ``slot_mapping`` ``[N]`` int64: the pool slot of each NEW token only
  (``block_table[p // block_size] * block_size + p % block_size``);
- ``positions`` ``[N]`` int64: ``start[i] .. seq_len[i] - 1`` per sequence (1-D RoPE; M-RoPE
  adapters offset it, see ``model/qwen2_vl.py``);
- ``decode``: the single-token rows, attended together (one index into the pool's blocks);
  ``chunks``: the longer rows, one entry each (no padding of a long prefill to the batch).
- ``static``: a fixed-shape decode step (``decode_graphs.py``, made there, not by
  :meth:`build`): its tensors are views of buffers refilled in place each step (a CUDA graph
  replays it), ``decode.ctx`` / ``max_seq_len`` are the upper bound, not the step's longest
  context, and its host arrays give only its padded shape; a backend derives no shape from
  a per-step value for it.

Masks are arguments, never dense host-built tensors: causal always; a layer's sliding window
comes from the attention call (``window``, as transformers passes ``sliding_window``);
bidirectional spans (absolute ``[lo, hi)`` position ranges per sequence, e.g. Gemma 3's image
tokens) are given to :meth:`build`; a window bounds a span too (transformers' Gemma 3 mask:
window AND (causal OR span)). A backend that needs a dense mask builds it on the device
from these arguments with vectorised ops, once per step and window (:meth:`DecodeRows.mask`,
:meth:`ChunkRows.mask` cache it), and reuses it across layers.

Invariants:
- No Python loop runs over context positions: host work is numpy over ``B`` sequences and
  their block ids; a Python loop runs only over the ``n > 1`` chunks (one entry each).
- :meth:`build` validates everything before a tensor is made (:class:`PagedAttentionError`),
  so the pool is never written with a bad step.
- Blocks a table holds beyond ``seq_len`` (look-ahead allocation) are ignored.
- The runner's path (``step_builder.build_step``) gives the same metadata as :meth:`build`
  from persistent block tables (``block_tables.BlockTables``), so a step's host work does not
  grow with context length. :meth:`build` stays the reference (tests, CUDA-graph checks,
  tensor parallel ranks).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np
import torch

Spans = Sequence[tuple[int, int]]


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a fresh CPU tensor the caller no longer changes) on ``device``: through pinned
    memory and a non-blocking copy on CUDA (the copy queues behind the step's kernels instead
    of stalling the host; torch's pinned-memory cache keeps the buffer until the copy ran),
    a plain copy elsewhere."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class PagedAttentionError(ValueError):
    """Inconsistent KV pool sizing or step metadata."""


def check_chunks(q: np.ndarray, s: np.ndarray, held: np.ndarray, block_size: int) -> np.ndarray:
    """Each sequence's length after the step (``s + q``); raises :class:`PagedAttentionError`
    for the first chunk of no tokens, a negative start, or a table too short for it (the
    checks ``AttentionMetadata.build`` and ``step_builder.build_step`` share)."""
    if (q < 1).any() or (s < 0).any():
        k = int(np.flatnonzero((q < 1) | (s < 0))[0])
        raise PagedAttentionError(f"bad chunk: {q[k]} tokens at start {s[k]}")
    seq = s + q
    short = np.flatnonzero(held * block_size < seq)
    if short.size:
        k = int(short[0])
        raise PagedAttentionError(f"block table of {held[k]} blocks cannot hold {seq[k]} tokens")
    return seq


def _allowed(
    q_pos: torch.Tensor, k_pos: torch.Tensor, k_len: torch.Tensor | int, window: int | None
) -> torch.Tensor:
    """Causal (+ window) visibility of keys ``k_pos`` from queries ``q_pos`` (broadcast)."""
    allowed = (k_pos <= q_pos) & (k_pos < k_len)
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


class DecodeRows:
    """The step's single-token rows, attended in one batched call over ``ctx`` key slots.

    ``block_index`` (``[Bd * num_blocks]`` int64, row-major) is either given or derived, on
    the table's device, from ``table`` (``[Bd, num_blocks]``, the step's rows of the
    persistent block tables) the first time a backend reads it: the paged kernels read
    ``AttentionMetadata.block_tables`` instead and never pay for it.

    ``every_token``: the rows are the step's tokens ``0 .. Bd - 1`` in order and the step has
    no other token (a decode-only step: ``step_builder._decode_step``, a decode graph's bucket),
    so ``token_index`` is ``arange(Bd)``: a backend then reads the query as it is and returns
    its result as the step's output, with no gather of the query rows and no scatter back
    (two kernels a layer fewer; ``benchmarks/kernel_count.py``).
    """

    def __init__(
        self,
        token_index: torch.Tensor,  # [Bd] packed row of each decode token
        block_index: torch.Tensor | None,  # [Bd * blocks] pool blocks, padded with block 0
        num_blocks: int,  # blocks per row in block_index
        seq_lens: torch.Tensor,  # [Bd] int64 context of each row (query included)
        ctx: int,  # max(seq_lens): keys attended per row (a prefix of the gathered blocks)
        uniform: bool,  # every row has exactly ctx keys: no mask needed without a window
        *,
        table: torch.Tensor | None = None,
        every_token: bool = False,
    ) -> None:
        if block_index is None and table is None:
            raise PagedAttentionError("decode rows need a block index or a table")
        self.token_index = token_index
        self._block_index = block_index
        self._table = table
        self.num_blocks = num_blocks
        self.seq_lens = seq_lens
        self.ctx = ctx
        self.uniform = uniform
        self.every_token = every_token
        self._masks: dict[int | None, torch.Tensor | None] = {}

    @property
    def block_index(self) -> torch.Tensor:
        index = self._block_index
        if index is None:
            table = self._table
            if table is None:  # pragma: no cover - __init__ refuses it
                raise PagedAttentionError("decode rows without a block index or a table")
            index = self._block_index = table.to(torch.long).reshape(-1).contiguous()
        return index

    @property
    def table(self) -> torch.Tensor:
        """``[Bd, num_blocks]``: each row's pool blocks in logical order, 0-padded."""
        if self._table is not None:
            return self._table
        return self.block_index.view(self.num, self.num_blocks)

    @property
    def num(self) -> int:
        return int(self.token_index.shape[0])

    def mask(self, window: int | None) -> torch.Tensor | None:
        """``[Bd, 1, 1, ctx]`` bool (True = attend), or None when every key is visible."""
        if window is None and self.uniform:
            return None
        if window not in self._masks:
            k_pos = torch.arange(self.ctx, device=self.seq_lens.device)[None, :]
            q_pos = (self.seq_lens - 1)[:, None]
            self._masks[window] = _allowed(q_pos, k_pos, self.seq_lens[:, None], window)[
                :, None, None, :
            ]
        return self._masks[window]


@dataclasses.dataclass
class ChunkRows:
    """One sequence's ``n > 1`` new tokens: packed rows ``lo .. hi - 1`` at ``start ..``."""

    lo: int
    hi: int
    start: int
    block_index: torch.Tensor  # [blocks] the pool blocks covering its context
    spans: tuple[tuple[int, int], ...] = ()  # bidirectional [lo, hi) position ranges
    _masks: dict[int | None, torch.Tensor | None] = dataclasses.field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.hi - self.lo

    @property
    def seq_len(self) -> int:
        return self.start + self.hi - self.lo

    def plain_causal(self, window: int | None) -> bool:
        """Whether a kernel's own top-left causal flag is exactly this chunk's mask."""
        return self.start == 0 and not self.spans and (window is None or window >= self.seq_len)

    def mask(self, window: int | None) -> torch.Tensor | None:
        """``[n, seq_len]`` bool (True = attend), or None when :meth:`plain_causal`."""
        if self.plain_causal(window):
            return None
        if window not in self._masks:
            device = self.block_index.device
            q_pos = torch.arange(self.start, self.seq_len, device=device)[:, None]
            k_pos = torch.arange(self.seq_len, device=device)[None, :]
            allowed = _allowed(q_pos, k_pos, self.seq_len, None)
            for lo, hi in self.spans:  # queries inside a span see the whole span
                allowed |= (q_pos >= lo) & (q_pos < hi) & (k_pos >= lo) & (k_pos < hi)
            if window is not None:  # the window bounds the span too, as in transformers
                allowed &= k_pos > q_pos - window
            self._masks[window] = allowed
        return self._masks[window]


@dataclasses.dataclass
class AttentionMetadata:
    """Index tensors of one step, shared by every layer (see the module docstring)."""

    block_size: int
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    cu_seqlens_k: torch.Tensor  # [B + 1] int32
    max_query_len: int
    max_seq_len: int
    slot_mapping: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    query_lens_host: np.ndarray  # [B] int64
    starts_host: np.ndarray  # [B] int64
    decode: DecodeRows | None
    chunks: tuple[ChunkRows, ...]
    has_spans: bool = False
    static: bool = False  # a fixed-shape decode step (see the module docstring)
    # what a backend derives from this step once and reuses in every layer (block masks);
    # a new step is a new object, so nothing here outlives its step
    scratch: dict[object, object] = dataclasses.field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        start_positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        num_slots: int,
        device: torch.device,
        bidirectional_spans: Sequence[Spans] | None = None,
    ) -> AttentionMetadata:
        count = len(query_lens)
        if not count or not (count == len(start_positions) == len(block_tables)):
            raise PagedAttentionError("a step needs one query length, start and block table each")
        q = np.asarray(query_lens, dtype=np.int64)
        s = np.asarray(start_positions, dtype=np.int64)
        held = np.fromiter(map(len, block_tables), dtype=np.int64, count=count)
        seq = check_chunks(q, s, held, block_size)
        flat = np.fromiter(
            itertools.chain.from_iterable(block_tables), dtype=np.int64, count=int(held.sum())
        )
        if flat.size and (flat.min() < 0 or (int(flat.max()) + 1) * block_size > num_slots):
            raise PagedAttentionError(f"a block table points outside the pool ({num_slots} slots)")
        width = int(held.max())
        table = np.zeros((count, width), dtype=np.int64)
        table[np.arange(width)[None, :] < held[:, None]] = flat
        needed = -(-seq // block_size)  # blocks covering each context
        table = table[:, : int(needed.max())]
        table[np.arange(table.shape[1])[None, :] >= needed[:, None]] = 0

        cu_q = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(q, out=cu_q[1:])
        cu_k = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(seq, out=cu_k[1:])
        num_tokens = int(cu_q[-1])
        row_seq = np.repeat(np.arange(count), q)
        pos = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu_q[:-1] - s, q)
        slots = table[row_seq, pos // block_size] * block_size + pos % block_size

        def put(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return to_device(torch.from_numpy(np.ascontiguousarray(array)).to(dtype), device)

        spans = bidirectional_spans or [()] * count
        is_decode = q == 1
        decode = None
        if is_decode.any():
            rows = np.flatnonzero(is_decode)
            lens = seq[rows]
            blocks = table[rows, : int(needed[rows].max())]
            decode = DecodeRows(
                token_index=put(cu_q[rows], torch.long),
                block_index=put(blocks.reshape(-1), torch.long),
                num_blocks=int(blocks.shape[1]),
                seq_lens=put(lens, torch.long),
                ctx=int(lens.max()),
                uniform=bool((lens == lens.max()).all()),
            )
        chunks = tuple(
            ChunkRows(
                lo=int(cu_q[i]),
                hi=int(cu_q[i + 1]),
                start=int(s[i]),
                block_index=put(table[i, : int(needed[i])], torch.long),
                spans=tuple((int(a), int(b)) for a, b in spans[i]),
            )
            for i in np.flatnonzero(~is_decode).tolist()
        )
        return cls(
            block_size=block_size,
            block_tables=put(table, torch.int32),
            seq_lens=put(seq, torch.int32),
            cu_seqlens_q=put(cu_q, torch.int32),
            cu_seqlens_k=put(cu_k, torch.int32),
            max_query_len=int(q.max()),
            max_seq_len=int(seq.max()),
            slot_mapping=put(slots, torch.long),
            positions=put(pos, torch.long),
            query_lens_host=q,
            starts_host=s,
            decode=decode,
            chunks=chunks,
            has_spans=any(c.spans for c in chunks),
        )
