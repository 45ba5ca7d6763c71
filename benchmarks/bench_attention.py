"""Attention bookkeeping per decode step: the step metadata of issue 11 vs the code before it.

    .venv/bin/python benchmarks/bench_attention.py [--sizes 64x1024 64x4096 256x2048]
        [--repeat 5] [--attention] [--layers 1] [--threads 1]

A decode step of ``B`` requests with ``C`` tokens of context each (every request one new
token; block tables of random, non-contiguous blocks of 16 slots, as a busy pool hands out).

- ``old``: a FROZEN COPY of the metadata builder and the attention forward as they were at
  commit 6f9aa47 (``_OldAttentionGroup`` / ``_old_build`` / ``_old_attention`` below, labelled,
  kept only as this benchmark's baseline): the slot of every context position listed in
  Python, a dense boolean mask built on the host, each sequence's context gathered per layer
  slot by slot;
- ``new``: :class:`~mmis.engine.execution.attn_metadata.AttentionMetadata` (numpy over sequences and
  block ids, new-token slots only) and the CPU backend of ``attn_backends.py``.

Host metadata time per step = building the step's metadata and position ids (what the runner
does once per step before any model compute); ``--attention`` also times ``--layers`` layers
of attention (KV write + attend) on a medium model's shape (14 query heads, 2 KV heads,
head_dim 64, float32) over the same step. Best of ``--repeat``, sides alternating; outputs of
old and new are compared. Target: new/old <= 0.1 for the metadata. The last line is
``SUMMARY bench_attention: ...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from mmis.engine.execution.attn_backends import TorchBackend
from mmis.engine.execution.attn_metadata import AttentionMetadata
from mmis.engine.execution.host_memory import keep_freed_memory

BLOCK = 16
HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64
TARGET = 0.1


# ---------------------------------------------------------------------------------------
# FROZEN BASELINE: paged_attention.py's metadata and forward at commit 6f9aa47 (before
# issue 11). Do not "fix" it: it is what the new code is measured against.
def _old_slots_for(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


@dataclasses.dataclass(frozen=True)
class _OldAttentionGroup:
    token_index: torch.Tensor
    query_index: torch.Tensor
    query_valid: torch.Tensor
    context_slots: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def build(
        cls, members: Sequence[tuple[int, int, int, list[int]]], device: torch.device
    ) -> _OldAttentionGroup:
        size, max_q = len(members), max(m[1] for m in members)
        max_c = max(len(m[3]) for m in members)
        query_index = torch.zeros(size, max_q, dtype=torch.long)
        query_valid = torch.zeros(size, max_q, dtype=torch.bool)
        context = torch.zeros(size, max_c, dtype=torch.long)
        mask = torch.zeros(size, 1, max_q, max_c, dtype=torch.bool)
        for i, (offset, n, start, slots) in enumerate(members):
            query_index[i, :n] = torch.arange(offset, offset + n)
            query_valid[i, :n] = True
            context[i, : start + n] = torch.tensor(slots, dtype=torch.long)
            rows = torch.arange(n).unsqueeze(1) + start
            mask[i, 0, :n, : start + n] = torch.arange(start + n).unsqueeze(0) <= rows
            mask[i, 0, n:, 0] = True
        return cls(
            token_index=query_index[query_valid].to(device),
            query_index=query_index.to(device),
            query_valid=query_valid.to(device),
            context_slots=context.to(device),
            mask=mask.to(device),
        )


@dataclasses.dataclass(frozen=True)
class _OldMetadata:
    slot_mapping: torch.Tensor
    groups: tuple[_OldAttentionGroup, ...]


def _old_build(
    query_lens: Sequence[int],
    start_positions: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    num_slots: int,
    device: torch.device,
) -> _OldMetadata:
    new_slots: list[int] = []
    decodes: list[tuple[int, int, int, list[int]]] = []
    chunks: list[tuple[int, int, int, list[int]]] = []
    offset = 0
    for n, start, table in zip(query_lens, start_positions, block_tables, strict=True):
        if n < 1 or start < 0:
            raise ValueError(f"bad chunk: {n} tokens at start {start}")
        if len(table) * block_size < start + n:
            raise ValueError("block table too short")
        if table and (min(table) < 0 or (max(table) + 1) * block_size > num_slots):
            raise ValueError("block table outside the pool")
        slots = _old_slots_for(table, 0, start + n, block_size)
        new_slots.extend(slots[start:])
        (decodes if n == 1 else chunks).append((offset, n, start, slots))
        offset += n
    groups = [_OldAttentionGroup.build([c], device) for c in chunks]
    if decodes:
        groups.append(_OldAttentionGroup.build(decodes, device))
    return _OldMetadata(
        slot_mapping=torch.tensor(new_slots, dtype=torch.long, device=device),
        groups=tuple(groups),
    )


def _old_positions(starts: Sequence[int], lens: Sequence[int]) -> torch.Tensor:
    return torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens, strict=True)])[None]


def _old_attention(
    pool: tuple[torch.Tensor, torch.Tensor],
    meta: _OldMetadata,
    query: torch.Tensor,  # [N, H, D]
    key: torch.Tensor,  # [N, KVH, D]
    value: torch.Tensor,
) -> torch.Tensor:
    keys, values = (t.view(-1, KV_HEADS, HEAD_DIM) for t in pool)
    keys.index_copy_(0, meta.slot_mapping, key)
    values.index_copy_(0, meta.slot_mapping, value)
    out = torch.empty_like(query)
    for group in meta.groups:
        ctx_k = keys[group.context_slots].transpose(1, 2)
        ctx_v = values[group.context_slots].transpose(1, 2)
        q = query[group.query_index].transpose(1, 2)
        attended = F.scaled_dot_product_attention(
            q, ctx_k, ctx_v, attn_mask=group.mask, enable_gqa=True
        )
        out[group.token_index] = attended.transpose(1, 2)[group.query_valid]
    return out


# END OF THE FROZEN BASELINE
# ---------------------------------------------------------------------------------------


def _new_attention(
    pool: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> torch.Tensor:
    key_cache, value_cache = pool
    flat = (-1, KV_HEADS, HEAD_DIM)
    key_cache.view(flat).index_copy_(0, meta.slot_mapping, key)
    value_cache.view(flat).index_copy_(0, meta.slot_mapping, value)
    return TorchBackend().attend(query, key_cache, value_cache, key, value, meta, None, None)


@dataclasses.dataclass
class DecodeStep:
    batch: int
    context: int
    tables: list[list[int]]
    num_blocks: int

    @classmethod
    def make(cls, batch: int, context: int, seed: int = 0) -> DecodeStep:
        per = -(-context // BLOCK)
        ids = list(range(1, 1 + batch * per))
        random.Random(seed).shuffle(ids)
        tables = [ids[i * per : (i + 1) * per] for i in range(batch)]
        return cls(batch, context, tables, 1 + batch * per)

    @property
    def lens(self) -> list[int]:
        return [1] * self.batch

    @property
    def starts(self) -> list[int]:
        return [self.context - 1] * self.batch


def _best(fn: Callable[[], Any], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _measure(size: str, args: argparse.Namespace) -> tuple[str, str, float]:
    """One size: (printed line, SUMMARY figure, metadata new/old)."""
    cpu = torch.device("cpu")
    batch, context = (int(v) for v in size.split("x"))
    step = DecodeStep.make(batch, context)
    num_slots = step.num_blocks * BLOCK

    def old_meta() -> tuple[_OldMetadata, torch.Tensor]:
        meta = _old_build(step.lens, step.starts, step.tables, BLOCK, num_slots, cpu)
        return meta, _old_positions(step.starts, step.lens)

    def new_meta() -> tuple[AttentionMetadata, torch.Tensor]:
        meta = AttentionMetadata.build(step.lens, step.starts, step.tables, BLOCK, num_slots, cpu)
        return meta, meta.positions.unsqueeze(0)

    t_old = t_new = float("inf")
    for _ in range(args.repeat):  # alternate, so a burst of load hits both
        t_old = min(t_old, _best(old_meta, 1))
        t_new = min(t_new, _best(new_meta, 1))
    (old_m, old_p), (new_m, new_p) = old_meta(), new_meta()
    same = old_m.slot_mapping.tolist() == new_m.slot_mapping.tolist()
    if not same or not torch.equal(old_p, new_p):
        raise SystemExit(f"{size}: old and new metadata disagree")
    ratio = t_new / t_old
    line = (
        f"{size:>9}: metadata old {t_old * 1e3:8.2f} ms  new {t_new * 1e3:7.3f} ms  "
        f"new/old {ratio:.4f}"
    )
    figure = f"{size} {t_old * 1e3:.1f}->{t_new * 1e3:.2f} ms ({ratio:.3f}x)"
    if not args.attention:
        return line, figure, ratio
    gen = torch.Generator().manual_seed(0)
    shape = (step.num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    pool = (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(batch, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(batch, KV_HEADS, HEAD_DIM, generator=gen)

    def old_step() -> torch.Tensor:
        meta, _ = old_meta()
        return [_old_attention(pool, meta, q, k, v) for _ in range(args.layers)][-1]

    def new_step() -> torch.Tensor:
        meta, _ = new_meta()
        return [_new_attention(pool, meta, q, k, v) for _ in range(args.layers)][-1]

    torch.testing.assert_close(new_step(), old_step())
    a_old = a_new = float("inf")
    for _ in range(max(1, args.repeat // 2)):
        a_old = min(a_old, _best(old_step, 1))
        a_new = min(a_new, _best(new_step, 1))
    line += (
        f"  | metadata + {args.layers} attention layer(s): old {a_old * 1e3:8.1f} ms"
        f"  new {a_new * 1e3:8.1f} ms  new/old {a_new / a_old:.3f}"
    )
    figure += f", with {args.layers} attention layer(s) {a_new / a_old:.2f}x"
    return line, figure, ratio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["64x1024", "64x4096", "256x2048"])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--attention", action="store_true", help="also time attention layers")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as P1 runs (engine/execution/host_memory.py): freed blocks stay mapped
    print(f"decode steps, block size {BLOCK}, best of {args.repeat}, {args.threads} thread(s)")
    figures, worst = [], 0.0
    for size in args.sizes:
        line, figure, ratio = _measure(size, args)
        print(line, flush=True)
        figures.append(figure)
        worst = max(worst, ratio)
    print(
        f"SUMMARY bench_attention: decode-step host metadata new/old {'; '.join(figures)}; "
        f"target <= {TARGET}x {'met' if worst <= TARGET else 'MISSED'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
