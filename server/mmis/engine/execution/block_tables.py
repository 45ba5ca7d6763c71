"""The runner's persistent block tables: one row per request, a step appends only the ids a
request's block list gained (``step_builder.build_step`` reads them; ``attn_metadata.py``
defines what a step's table is)."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import torch

from mmis.engine.execution.attn_metadata import PagedAttentionError


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
