"""The runner's incremental step metadata (``step_builder.build_step`` over persistent
``BlockTables`` rows: a request's row only gains ids, ended requests release theirs) equals
``AttentionMetadata.build`` from scratch, tensor for tensor and error for error, over random
step sequences: requests arriving, ending, chunked, decoding, reordered, a block table list
replaced by a new list object, bidirectional spans. Tensor-parallel workers, CUDA graph
capture and the backend probe build with ``AttentionMetadata.build``; rank 0 steps with
``build_step``: the two must never differ.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from mmis.engine.execution.attn_metadata import AttentionMetadata, PagedAttentionError
from mmis.engine.execution.block_tables import BlockTables
from mmis.engine.execution.step_builder import HostToDevice, build_step

CPU = torch.device("cpu")
BS, NB = 4, 4000


def same(a: AttentionMetadata, b: AttentionMetadata) -> None:
    for f in (
        "block_tables",
        "seq_lens",
        "cu_seqlens_q",
        "cu_seqlens_k",
        "slot_mapping",
        "positions",
    ):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), (f, x, y)
    assert a.max_query_len == b.max_query_len and a.max_seq_len == b.max_seq_len
    assert (a.query_lens_host == b.query_lens_host).all() and (a.starts_host == b.starts_host).all()
    assert (a.decode is None) == (b.decode is None)
    if a.decode:
        for f in ("token_index", "block_index", "seq_lens"):
            x, y = getattr(a.decode, f), getattr(b.decode, f)
            assert x.dtype == y.dtype and torch.equal(x, y), (f, x, y)
        da, db = a.decode, b.decode
        assert (da.num_blocks, da.ctx, da.uniform) == (db.num_blocks, db.ctx, db.uniform)
        for w in (None, 3):
            ma, mb = a.decode.mask(w), b.decode.mask(w)
            assert (ma is None and mb is None) or torch.equal(ma, mb)
    assert len(a.chunks) == len(b.chunks)
    for c, d in zip(a.chunks, b.chunks, strict=True):
        assert (c.lo, c.hi, c.start, c.spans) == (d.lo, d.hi, d.start, d.spans)
        assert torch.equal(c.block_index, d.block_index)
        assert c.block_index.dtype == d.block_index.dtype
    assert a.has_spans == b.has_spans


@pytest.mark.parametrize("seed", range(4))
def test_incremental_metadata_equals_a_fresh_build(seed: int) -> None:
    rng = random.Random(seed)
    for _trial in range(25):
        tables = BlockTables(BS, NB * BS, CPU)
        up = HostToDevice(CPU)
        reqs: dict[str, list] = {}  # id -> [start, block list]
        nid = 0
        for _step in range(rng.randint(1, 40)):
            for _ in range(rng.randint(0, 3)):  # arrivals
                reqs[f"r{nid}"] = [0, []]
                nid += 1
            ended = [r for r in list(reqs) if rng.random() < 0.1]
            for r in ended:
                del reqs[r]
            tables.release(ended)
            if rng.random() < 0.05 and reqs:  # a block table handed over as a new list
                r = rng.choice(list(reqs))
                reqs[r][1] = list(reqs[r][1])
            ids = [r for r in reqs if rng.random() < 0.8]
            if rng.random() < 0.3:
                rng.shuffle(ids)
            if not ids:
                continue
            q, s, t, spans = [], [], [], []
            for r in ids:
                st, lst = reqs[r]
                n = 1 if st and rng.random() < 0.7 else rng.randint(1, 12)
                need = -(-(st + n) // BS) + (1 if rng.random() < 0.1 else 0)
                while len(lst) < need:
                    lst.append(rng.randint(0, NB - 1))
                q.append(n)
                s.append(st)
                t.append(lst)
                spans.append([(0, 2)] if rng.random() < 0.1 else [])
                reqs[r][0] = st + n
            sp = spans if rng.random() < 0.3 else None
            ref = AttentionMetadata.build(q, s, t, BS, NB * BS, CPU, bidirectional_spans=sp)
            extra = [(np.arange(3), torch.long)]
            got, sent = build_step(q, s, ids, t, tables, up, bidirectional_spans=sp, extra=extra)
            same(got, ref)
            assert sent[0].tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([1], [0], [[11]]), "outside"),
        (([5], [0], [[1]]), "cannot hold"),
        (([0], [0], [[1]]), "bad chunk"),
    ],
)
def test_incremental_metadata_refuses_what_a_fresh_build_refuses(args: tuple, message: str) -> None:
    q, s, t = args
    with pytest.raises(PagedAttentionError, match=message):
        build_step(q, s, ["x"], t, BlockTables(BS, 10 * BS, CPU), HostToDevice(CPU))
    with pytest.raises(PagedAttentionError, match=message):
        AttentionMetadata.build(q, s, t, BS, 10 * BS, CPU)


POOL = 64  # blocks of the small pool below: id 64 points outside it


def _decode(
    tables: BlockTables, up: HostToDevice, ids: list[str], lists: list[list[int]], starts: list[int]
) -> list[int]:
    """One decode step of ``ids`` that must equal a fresh build; the next starts."""
    for k, st in enumerate(starts):
        while len(lists[k]) * BS < st + 1:  # the KV manager appends a block when one fills
            lists[k].append(1 + (7 * len(lists[k]) + k) % (POOL - 1))
    q = [1] * len(ids)
    ref = AttentionMetadata.build(q, starts, lists, BS, POOL * BS, CPU)
    same(build_step(q, starts, ids, lists, tables, up)[0], ref)
    return [st + 1 for st in starts]


@pytest.mark.parametrize("case", ["shrunk", "grew_outside", "released"])
def test_incremental_metadata_refuses_what_its_persistent_rows_could_hide(case: str) -> None:
    """Refusals only ``build_step`` could miss, since it reads rows filled by earlier steps:
    a list that lost blocks its row still holds (``shrunk``: the row's stale ids must not
    serve the token), a row gaining an id outside the pool (only the new ids are checked: the
    check must cover them, before anything is written), a released request back with its
    list object refilled in place (``released``: its row must be refilled, and checked, not
    reused). Each is refused as a fresh build refuses it, the table untouched; once the list
    is right again, steps equal a fresh build again."""
    tables, up = BlockTables(BS, POOL * BS, CPU), HostToDevice(CPU)
    ids, lists, starts = ["a", "b", "c"], [[], [], []], [5, 9, 13]
    for _ in range(6):  # steady decoding: the rows are filled, the steps incremental
        starts = _decode(tables, up, ids, lists, starts)
    victim = lists[1]
    if case == "shrunk":  # the same object, too short for its next token
        removed = victim[starts[1] // BS :]
        del victim[starts[1] // BS :]
        message, restore = "cannot hold", lambda: victim.extend(removed)
    elif case == "grew_outside":  # its next token opens a block: an id outside the pool
        starts[1] = len(victim) * BS
        victim.append(POOL)
        message, restore = "outside", lambda: victim.__setitem__(-1, 3)
    else:
        tables.release(["b"])
        good, victim[0] = victim[0], POOL  # same length, same object, a bad id in the prefix
        message, restore = "outside", lambda: victim.__setitem__(0, good)
    before = tables.host.copy()
    q = [1] * len(ids)
    with pytest.raises(PagedAttentionError, match=message):
        AttentionMetadata.build(q, starts, lists, BS, POOL * BS, CPU)
    with pytest.raises(PagedAttentionError, match=message):
        build_step(q, starts, ids, lists, tables, up)
    assert np.array_equal(tables.host[: before.shape[0], : before.shape[1]], before)
    restore()
    for _ in range(6):
        starts = _decode(tables, up, ids, lists, starts)


def test_steady_decode_steps_equal_a_fresh_build() -> None:
    """The same requests decoding step after step (``BlockTables.rows`` visits only the
    rows whose list grew), then one list handed over as a new object with other ids, then a
    request ending: every step equals a fresh build."""
    rng = random.Random(7)
    tables, up = BlockTables(BS, NB * BS, CPU), HostToDevice(CPU)
    ids = [f"s{k}" for k in range(5)]
    starts = [rng.randint(1, 30) for _ in ids]
    lists = [[rng.randint(1, NB - 1) for _ in range(-(-(st + 1) // BS))] for st in starts]
    for step in range(60):
        if step == 25:  # same id, a new list object with other ids: its row is refilled
            lists[2] = [rng.randint(1, NB - 1) for _ in lists[2]]
        if step == 40:  # a request ends: the next step is not the previous one's rows
            tables.release([ids[1]])
            del ids[1], starts[1], lists[1]
        for k, st in enumerate(starts):
            while len(lists[k]) * BS < st + 1:
                lists[k].append(rng.randint(1, NB - 1))
        q = [1] * len(ids)
        ref = AttentionMetadata.build(q, starts, lists, BS, NB * BS, CPU)
        got, _ = build_step(q, starts, ids, lists, tables, up)
        same(got, ref)
        starts = [st + 1 for st in starts]
