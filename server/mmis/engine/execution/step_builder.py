"""The runner's step metadata, built incrementally: :func:`build_step` gives
``AttentionMetadata.build``'s metadata (equal, tensor for tensor) from the persistent rows of
``block_tables.BlockTables``, and :class:`HostToDevice` sends all of a step's host arrays to
the device in one copy (pinned and non-blocking on CUDA). A decode-only step (the steady
state) takes a shorter path whose host work does not grow with context length."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mmis.engine.execution.attn_metadata import (
    AttentionMetadata,
    ChunkRows,
    DecodeRows,
    PagedAttentionError,
    Spans,
    check_chunks,
)
from mmis.engine.execution.block_tables import BlockTables


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
        self._constants: dict[int, tuple[np.ndarray, np.ndarray, torch.Tensor, torch.Tensor]] = {}
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def decode_constants(
        self, count: int
    ) -> tuple[np.ndarray, np.ndarray, torch.Tensor, torch.Tensor]:
        """For a step of ``count`` decode rows: ``arange(count)`` and the query lengths
        (``ones(count)``) on the host, and on the device ``cu_seqlens_q`` (``arange(count + 1)``
        int32) and the packed row of each decode token (``arange(count)`` int64); made once per
        batch size (read only, as all metadata)."""
        cached = self._constants.get(count)
        if cached is None:
            host = np.arange(count + 1, dtype=np.int64)
            cached = (
                host[:count],
                _read_only(np.ones(count, dtype=np.int64)),
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


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _as_numpy(array: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    want = _NUMPY[dtype]
    if array.dtype != want:
        return array.astype(want)
    return array


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
            span = (lowest, max(start_positions))
            return _decode_step(
                s, span, held, last, request_ids, block_tables, tables, upload, extra
            )
    q = np.array(query_lens, dtype=np.int64)
    s = np.array(start_positions, dtype=np.int64)
    held = np.fromiter(map(len, block_tables), dtype=np.int64, count=count)
    seq = check_chunks(q, s, held, bs)
    rows = tables.rows(request_ids, block_tables, held)
    needed = -(-seq // bs)  # blocks covering each context
    width = int(needed.max())
    look_ahead = bool((held > needed).any())  # blocks past a context: cut to the null block
    table = _step_table(tables, rows, width, needed, look_ahead)

    cu_q = np.zeros(count + 1, dtype=np.int64)
    np.add.accumulate(q, out=cu_q[1:])  # np.cumsum, without its Python wrapper
    cu_k = np.zeros(count + 1, dtype=np.int64)
    np.add.accumulate(seq, out=cu_k[1:])
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
    index, ones, cu_q_t, token_index = upload.decode_constants(count)
    seq = s + 1
    cu_k = np.zeros(count + 1, dtype=np.int64)
    np.add.accumulate(seq, out=cu_k[1:])
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
        every_token=True,
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
        query_lens_host=ones,
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
