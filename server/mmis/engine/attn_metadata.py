"""Per-step attention metadata: built once per step as tensors, read by every layer.

A step packs ``B`` sequences (``N`` new tokens in all, batch size 1) in
:class:`~mmis.engine.sched_output.SchedulerOutput` order. Sequence ``i`` has ``start[i]``
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
- The runner's path (:func:`build_step`) gives the same metadata as :meth:`build` from
  persistent block tables (:class:`BlockTables`: one row per request; a new block appends an
  id, nothing is rebuilt), so a step's host work does not grow with context length; all of a
  step's host arrays reach the device in one copy (:class:`HostToDevice`: pinned and
  non-blocking on CUDA). :meth:`build` stays the reference (tests, CUDA-graph checks, tensor
  parallel ranks).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
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
        if (q < 1).any() or (s < 0).any():
            k = int(np.flatnonzero((q < 1) | (s < 0))[0])
            raise PagedAttentionError(f"bad chunk: {q[k]} tokens at start {s[k]}")
        seq = s + q
        held = np.fromiter(map(len, block_tables), dtype=np.int64, count=count)
        short = np.flatnonzero(held * block_size < seq)
        if short.size:
            k = int(short[0])
            raise PagedAttentionError(
                f"block table of {held[k]} blocks cannot hold {seq[k]} tokens"
            )
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


class HostToDevice:
    """A step's host index arrays on the device, in ONE copy.

    On CUDA the arrays are packed into a pinned int64 staging buffer and moved with one
    non-blocking copy (two buffers used in turn; a buffer is refilled only after the event of
    its previous copy completed, so a queued copy never reads a refilled buffer), then cast
    on the device to the dtype each array asks for. Elsewhere each array becomes a tensor that
    shares its memory (``torch.from_numpy``): no copy at all.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._constants: dict[int, tuple[np.ndarray, torch.Tensor, torch.Tensor]] = {}
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def decode_constants(self, count: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """For a step of ``count`` decode rows: ``arange(count)`` on the host, and on the device
        ``cu_seqlens_q`` (``arange(count + 1)`` int32) and the packed row of each decode token
        (``arange(count)`` int64); made once per batch size (read only, as all metadata)."""
        cached = self._constants.get(count)
        if cached is None:
            host = np.arange(count + 1, dtype=np.int64)
            cached = (
                host[:count],
                torch.arange(count + 1, dtype=torch.int32, device=self.device),
                torch.arange(count, dtype=torch.long, device=self.device),
            )
            self._constants[count] = cached
        return cached

    def send(self, arrays: Sequence[tuple[np.ndarray, torch.dtype]]) -> list[torch.Tensor]:
        if self.device.type != "cuda":
            return [torch.from_numpy(_as_numpy(a, dtype)) for a, dtype in arrays]
        sizes = [int(a.size) for a, _ in arrays]
        total = sum(sizes)
        turn, self._turn = self._turn, self._turn ^ 1
        event, buffer = self._events[turn], self._buffers[turn]
        if event is not None:
            event.synchronize()  # its previous copy ran (long since, in the steady state)
        if buffer is None or buffer.numel() < total:
            buffer = torch.empty(max(total, 4096, 2 * total), dtype=torch.long, pin_memory=True)
            self._buffers[turn] = buffer
        host = buffer.numpy()
        offset = 0
        for (array, _), size in zip(arrays, sizes, strict=True):
            host[offset : offset + size] = array.reshape(-1)
            offset += size
        moved = buffer[:total].to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[turn] = event
        out, offset = [], 0
        for (array, dtype), size in zip(arrays, sizes, strict=True):
            part = moved[offset : offset + size].view(array.shape)
            out.append(part if dtype == torch.long else part.to(dtype))
            offset += size
        return out


_NUMPY = {torch.int32: np.int32, torch.long: np.int64}


def _as_numpy(array: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    want = _NUMPY[dtype]
    if array.dtype != want:
        return array.astype(want)
    return array


def _first_of_run(rows: np.ndarray) -> int | None:
    """``rows[0]`` when ``rows`` are consecutive integers, else ``None``."""
    count, first = int(rows.shape[0]), int(rows[0])
    if int(rows[-1]) - first == count - 1 and (count < 3 or bool((np.diff(rows) == 1).all())):
        return first
    return None


# a step's (request ids, their lists, rows, list lengths after it): ``BlockTables.rows``
_LastStep = tuple[tuple[str, ...], tuple[Sequence[int], ...], np.ndarray, np.ndarray]


class BlockTables:
    """The block tables of the requests a runner has seen: one persistent row each.

    Invariants:
    - Row ``r`` holds, in its first ``filled[r]`` columns, the ids of ONE block list object
      (the KV manager's per-request list, ``kv_cache.KVCacheManager.block_ids``: append-only
      while the request holds its blocks); every other entry of the table is the null block 0.
    - Block tables are persistent: a step appends only the ids its lists gained since the
      previous step (a new block appends an id; nothing is rebuilt), so the host work of a
      decode step does not grow with the context. A list that is not the object a row was
      filled from (a request back after preemption, a table made by hand) refills its row.
    - An id is checked against the pool when it enters a row (:class:`PagedAttentionError`),
      before anything is written.
    - :meth:`release` (the runner's ended requests) zeroes a row and frees it for reuse.
    - The rows live in a host array; on CUDA also in a device tensor, updated with the
      changed entries as part of the step's one host->device copy (:meth:`device_updates`).
    """

    def __init__(self, block_size: int, num_slots: int, device: torch.device) -> None:
        self.block_size, self.num_slots, self.device = block_size, num_slots, device
        self.host = np.zeros((8, 16), dtype=np.int32)
        self._device_table: torch.Tensor | None = None
        self._stale = True  # the device table must be uploaded whole (new, or grown)
        self._row: dict[str, int] = {}
        self._source: list[Sequence[int] | None] = [None] * 8
        self._filled: list[int] = [0] * 8
        self._free: list[int] = list(range(7, -1, -1))  # popped from the end: lowest first
        self._updates: list[tuple[int, int, int]] = []  # (row, first column, end column)
        # the previous step's (request ids, their lists, rows, list lengths after it)
        self._last: _LastStep | None = None
        self._first: int | None = None  # first_row of the last rows returned

    def __len__(self) -> int:
        return len(self._row)

    def release(self, request_ids: Sequence[str]) -> None:
        if request_ids:
            self._last = None
        for request_id in request_ids:
            row = self._row.pop(request_id, None)
            if row is None:
                continue
            self._clear(row)
            self._source[row] = None
            self._free.append(row)

    def _clear(self, row: int) -> None:
        filled = self._filled[row]
        if filled:
            self.host[row, :filled] = 0
            self._updates.append((row, 0, filled))
            self._filled[row] = 0

    def _check(self, ids: Sequence[int]) -> None:
        if ids and (min(ids) < 0 or (max(ids) + 1) * self.block_size > self.num_slots):
            raise PagedAttentionError(
                f"a block table points outside the pool ({self.num_slots} slots)"
            )

    def _grow(self, rows: int, cols: int) -> None:
        old_rows, old_cols = self.host.shape
        new_rows = old_rows if rows <= old_rows else max(rows, 2 * old_rows)
        new_cols = old_cols if cols <= old_cols else max(cols, 2 * old_cols)
        grown = np.zeros((new_rows, new_cols), dtype=np.int32)
        grown[:old_rows, :old_cols] = self.host
        self.host = grown
        self._source.extend([None] * (new_rows - old_rows))
        self._filled.extend([0] * (new_rows - old_rows))
        self._free[:0] = list(range(new_rows - 1, old_rows - 1, -1))
        self._stale = True

    def rows(
        self, request_ids: Sequence[str], tables: Sequence[Sequence[int]], held: np.ndarray
    ) -> np.ndarray:
        """The row of each request (int64), its new ids appended (or its row refilled);
        ``held``: ``len`` of each table. A step with the previous step's requests in the
        same order, each with the same list (the steady state of decoding), visits only the
        rows whose list grew."""
        last, request_ids = self._last, tuple(request_ids)
        if (
            last is not None
            and request_ids == last[0]
            and all(map(operator.is_, tables, last[1]))
            and held.shape == last[3].shape
        ):
            rows = last[2]
            grown = np.flatnonzero(held != last[3])
            if grown.size:
                self._visit(
                    [request_ids[k] for k in grown.tolist()], [tables[k] for k in grown.tolist()]
                )
            self._last = (last[0], last[1], rows, held)
            return rows
        rows = np.array(self._visit(request_ids, tables), dtype=np.int64)
        self._last = (request_ids, tuple(tables), rows, held)
        self._first = _first_of_run(rows)
        return rows

    def first_row(self, rows: np.ndarray) -> int | None:
        """The first of ``rows`` when they are consecutive (a view of the host table serves
        the step), else ``None``; known without a pass for the rows :meth:`rows` returned."""
        if self._last is not None and rows is self._last[2]:
            return self._first
        return _first_of_run(rows)

    def _visit(self, request_ids: Sequence[str], tables: Sequence[Sequence[int]]) -> list[int]:
        out = []
        row_of, source, filled = self._row, self._source, self._filled
        for request_id, table in zip(request_ids, tables, strict=True):
            row = row_of.get(request_id)
            if row is None:
                if not self._free:
                    self._grow(2 * self.host.shape[0], 0)
                row = self._free.pop()
                row_of[request_id] = row
            have, size = filled[row], len(table)
            if source[row] is table and size >= have:
                if size > have:  # the blocks it gained since the previous step
                    self._write(row, table, have, size)
            else:  # first sight of this list: fill the row from it
                self._clear(row)
                source[row] = table
                self._write(row, table, 0, size)
            out.append(row)
        return out

    def _write(self, row: int, table: Sequence[int], lo: int, hi: int) -> None:
        new = table[lo:hi]
        self._check(new)
        if hi > self.host.shape[1]:
            self._grow(0, hi)
        self.host[row, lo:hi] = new
        self._filled[row] = hi
        self._updates.append((row, lo, hi))

    def device_table(self) -> torch.Tensor:
        """The rows on the device (CUDA: after :meth:`apply_device_updates`; else a view of
        the host array)."""
        if self.device.type != "cuda" or self._device_table is None:
            return torch.from_numpy(self.host)
        return self._device_table

    def device_updates(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(flat positions, ids) of the entries changed since the last upload (CUDA), to
        travel in the step's one copy; ``None`` when there are none or the whole table goes
        up (a new or grown table, :meth:`apply_device_updates`)."""
        if self.device.type != "cuda" or self._stale or not self._updates:
            return None
        width = self.host.shape[1]
        flat = np.concatenate(
            [
                np.arange(r * width + lo, r * width + hi, dtype=np.int64)
                for r, lo, hi in self._updates
            ]
        )
        return flat, self.host.reshape(-1)[flat].astype(np.int64)

    def apply_device_updates(self, update: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Write the uploaded changes into the device table (CUDA; a new or grown table is
        uploaded whole instead, once)."""
        if self.device.type != "cuda":
            self._updates.clear()
            return
        if self._stale or self._device_table is None:
            self._device_table = torch.from_numpy(self.host).to(self.device)
            self._stale = False
        elif update is not None:
            flat, ids = update
            self._device_table.view(-1).index_copy_(0, flat, ids.to(torch.int32))
        self._updates.clear()


def build_step(
    query_lens: Sequence[int],
    start_positions: Sequence[int],
    request_ids: Sequence[str],
    block_tables: Sequence[Sequence[int]],
    tables: BlockTables,
    upload: HostToDevice,
    bidirectional_spans: Sequence[Spans] | None = None,
    extra: Sequence[tuple[np.ndarray, torch.dtype]] = (),
) -> tuple[AttentionMetadata, list[torch.Tensor]]:
    """:meth:`AttentionMetadata.build`'s metadata (equal, tensor for tensor, and refused with
    the same errors) from the persistent rows of ``tables`` (the runner's path), and the
    ``extra`` host arrays of the step on the device, all in ``upload``'s one copy.

    Host work is numpy over the ``B`` sequences and the ``N`` new tokens plus the ids the
    tables gained; the step's ``[B, max_blocks]`` table is a view of the persistent rows (or
    one gather of them, on the device on CUDA), never rebuilt from lists. A step of decode
    rows only (the steady state) takes a shorter path: fewer numpy calls, and its constant
    arrays (``cu_seqlens_q``, the decode rows' packed indexes) cached per batch size.
    """
    count = len(query_lens)
    if not count or not (count == len(start_positions) == len(block_tables) == len(request_ids)):
        raise PagedAttentionError("a step needs one query length, start and block table each")
    bs = tables.block_size
    if list(query_lens).count(1) == count and (lowest := min(start_positions)) >= 0:
        s = np.array(start_positions, dtype=np.int64)
        held = np.fromiter(map(len, block_tables), dtype=np.int64, count=count)
        last = s // bs  # the block of each new token
        if not (held <= last).any():  # else the general path below refuses the step
            span = (lowest, int(s.max()))
            return _decode_step(
                s, span, held, last, request_ids, block_tables, tables, upload, extra
            )
    q = np.array(query_lens, dtype=np.int64)
    s = np.array(start_positions, dtype=np.int64)
    if (q < 1).any() or (s < 0).any():
        k = int(np.flatnonzero((q < 1) | (s < 0))[0])
        raise PagedAttentionError(f"bad chunk: {q[k]} tokens at start {s[k]}")
    seq = s + q
    held = np.fromiter(map(len, block_tables), dtype=np.int64, count=count)
    short = np.flatnonzero(held * bs < seq)
    if short.size:
        k = int(short[0])
        raise PagedAttentionError(f"block table of {held[k]} blocks cannot hold {seq[k]} tokens")
    rows = tables.rows(request_ids, block_tables, held)
    needed = -(-seq // bs)  # blocks covering each context
    width = int(needed.max())
    look_ahead = bool((held > needed).any())  # blocks past a context: cut to the null block
    table = _step_table(tables, rows, width, needed, look_ahead)

    cu_q = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(q, out=cu_q[1:])
    cu_k = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(seq, out=cu_k[1:])
    num_tokens = int(cu_q[-1])
    row_seq = np.repeat(np.arange(count), q)
    pos = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu_q[:-1] - s, q)
    slots = table[row_seq, pos // bs].astype(np.int64) * bs + pos % bs

    is_decode = q == 1
    decode_rows = np.flatnonzero(is_decode)
    lens = seq[decode_rows]
    staged: list[tuple[np.ndarray, torch.dtype]] = [
        (seq, torch.int32),
        (cu_q, torch.int32),
        (cu_k, torch.int32),
        (slots, torch.long),
        (pos, torch.long),
        (cu_q[decode_rows], torch.long),
        (lens, torch.long),
    ]
    if upload.device.type == "cuda":
        staged.append((decode_rows.astype(np.int64), torch.long))
    moved, table_t, extras = _send(staged, extra, tables, upload, rows, table, needed, look_ahead)
    seq_t, cu_q_t, cu_k_t, slots_t, pos_t, token_index, lens_t = moved[:7]

    decode = None
    if decode_rows.size:
        num_blocks = int(needed[decode_rows].max())
        if upload.device.type == "cuda":
            decode_table = table_t.index_select(0, moved[7])[:, :num_blocks]
        else:
            decode_table = torch.from_numpy(table[decode_rows, :num_blocks])
        ctx = int(lens.max())
        decode = DecodeRows(
            token_index=token_index,
            block_index=None,
            num_blocks=num_blocks,
            seq_lens=lens_t,
            ctx=ctx,
            uniform=bool((lens == ctx).all()),
            table=decode_table,
        )
    spans = bidirectional_spans or [()] * count
    chunks = tuple(
        ChunkRows(
            lo=int(cu_q[i]),
            hi=int(cu_q[i + 1]),
            start=int(s[i]),
            block_index=(
                table_t[i, : int(needed[i])].to(torch.long)
                if upload.device.type == "cuda"
                else torch.from_numpy(table[i, : int(needed[i])].astype(np.int64))
            ),
            spans=tuple((int(a), int(b)) for a, b in spans[i]),
        )
        for i in np.flatnonzero(~is_decode).tolist()
    )
    meta = AttentionMetadata(
        block_size=bs,
        block_tables=table_t,
        seq_lens=seq_t,
        cu_seqlens_q=cu_q_t,
        cu_seqlens_k=cu_k_t,
        max_query_len=int(q.max()),
        max_seq_len=int(seq.max()),
        slot_mapping=slots_t,
        positions=pos_t,
        query_lens_host=q,
        starts_host=s,
        decode=decode,
        chunks=chunks,
        has_spans=any(c.spans for c in chunks),
    )
    return meta, extras


def _decode_step(
    s: np.ndarray,
    span: tuple[int, int],
    held: np.ndarray,
    last: np.ndarray,
    request_ids: Sequence[str],
    block_tables: Sequence[Sequence[int]],
    tables: BlockTables,
    upload: HostToDevice,
    extra: Sequence[tuple[np.ndarray, torch.dtype]],
) -> tuple[AttentionMetadata, list[torch.Tensor]]:
    """:func:`build_step` of a step whose every row is one new token at ``s`` (checked: each
    table holds the block ``last`` of its token; ``span``: the least and greatest of ``s``)."""
    count, bs = int(s.shape[0]), tables.block_size
    rows = tables.rows(request_ids, block_tables, held)
    needed = last + 1
    width = span[1] // bs + 1  # needed.max()
    look_ahead = bool((held > needed).any())
    table = _step_table(tables, rows, width, needed, look_ahead)
    index, cu_q_t, token_index = upload.decode_constants(count)
    seq = s + 1
    cu_k = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(seq, out=cu_k[1:])
    slots = table[index, last].astype(np.int64) * bs + s % bs
    staged: list[tuple[np.ndarray, torch.dtype]] = [
        (seq, torch.int32),
        (cu_k, torch.int32),
        (slots, torch.long),
        (s.copy(), torch.long),
        (seq, torch.long),
    ]
    moved, table_t, extras = _send(staged, extra, tables, upload, rows, table, needed, look_ahead)
    seq_t, cu_k_t, slots_t, pos_t, lens_t = moved[:5]
    lo, ctx = span[0] + 1, span[1] + 1  # seq.min(), seq.max()
    decode = DecodeRows(
        token_index=token_index,
        block_index=None,
        num_blocks=width,
        seq_lens=lens_t,
        ctx=ctx,
        uniform=lo == ctx,
        table=table_t,
    )
    meta = AttentionMetadata(
        block_size=bs,
        block_tables=table_t,
        seq_lens=seq_t,
        cu_seqlens_q=cu_q_t,
        cu_seqlens_k=cu_k_t,
        max_query_len=1,
        max_seq_len=ctx,
        slot_mapping=slots_t,
        positions=pos_t,
        query_lens_host=np.ones(count, dtype=np.int64),
        starts_host=s,
        decode=decode,
        chunks=(),
        has_spans=False,
    )
    return meta, extras


def _step_table(
    tables: BlockTables, rows: np.ndarray, width: int, needed: np.ndarray, look_ahead: bool
) -> np.ndarray:
    """The step's ``[B, width]`` host table: a view of the persistent rows when the step's
    rows are consecutive (the steady state), else one gather; ids past each context cut to
    the null block (a copy then)."""
    count, first = int(rows.shape[0]), tables.first_row(rows)
    if first is not None:
        table = tables.host[first : first + count, :width]
        if look_ahead:
            table = table.copy()
    else:
        table = tables.host[rows, :width]
    if look_ahead:
        table[np.arange(width)[None, :] >= needed[:, None]] = 0
    return table


def _send(
    staged: list[tuple[np.ndarray, torch.dtype]],
    extra: Sequence[tuple[np.ndarray, torch.dtype]],
    tables: BlockTables,
    upload: HostToDevice,
    rows: np.ndarray,
    table: np.ndarray,
    needed: np.ndarray,
    look_ahead: bool,
) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """The step's one copy: ``staged`` (then, on CUDA, the table's changed entries and the
    step's rows) and ``extra``; returns the staged tensors, the step's table on the device
    and the extra tensors."""
    if upload.device.type != "cuda":
        moved = upload.send([*staged, *extra])
        tables.apply_device_updates(None)
        return moved[: len(staged)], torch.from_numpy(table), moved[len(staged) :]
    own = [(rows, torch.long), (needed, torch.long)]
    update = tables.device_updates()
    if update is not None:
        own += [(update[0], torch.long), (update[1], torch.long)]
    moved = upload.send([*staged, *own, *extra])
    first = len(staged) + len(own)
    rows_t, needed_t = moved[len(staged)], moved[len(staged) + 1]
    tables.apply_device_updates(
        (moved[len(staged) + 2], moved[len(staged) + 3]) if update is not None else None
    )
    width = int(table.shape[1])
    table_t = tables.device_table()[:, :width].index_select(0, rows_t)
    if look_ahead:
        cut = torch.arange(width, device=table_t.device)[None, :] >= needed_t[:, None]
        table_t.masked_fill_(cut, 0)
    return moved[: len(staged)], table_t, moved[first:]
