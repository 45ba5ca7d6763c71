"""The LoRA projection: a wrapper around a linear holding every device slot's weights, and the
grouped apply over a batch's rows.

Design (after studying vLLM's punica ``bgmv``/``sgmv`` and SGLang's segment GEMMs; no code
copied): a layer with ``S = max_loras + 1`` slots holds ``A`` as ``[S, r_max, in]`` and ``B``
transposed per slot, ``[S, r_max, out]`` (so both flatten to one matrix without a copy); ranks
below ``r_max`` are zero-padded and slot 0 is all zeros (no adapter). The shared
:class:`LoRARows` of a forward holds, built once per step (never per layer), each row's slot
on the device and what the step needs of it:

- one adapter in the step (:attr:`LoRARows.single`: every row of a tower call, a step whose
  rows all use one adapter, or that adapter and base rows): the delta is that slot's own
  rank-``r`` pair, ``((x @ A_s^T) * m) @ B_s`` (``m`` the rows' 0/1 column, absent when every
  row has the adapter);
- several: :func:`grouped_lora_delta` over every slot's columns,

    delta = ((x @ A_flat^T) * mask) @ B_flat

  with ``mask`` ``[..., S * r_max]`` each row's one-hot slot repeated over its ``r_max``
  columns (:meth:`LoRARows.flat_mask`, built at the first layer of the step and reused).

Either is two GEMMs and one multiply per projection whatever the mix of adapters (fixed
shapes, one launch each, no host sync), never a loop over adapters; the delta is accumulated
into the base output in place (``addmm_``). The grouped form spends ``S * r_max`` columns
where a gather would spend ``r_max``: at vLLM's defaults (4 adapters, rank 16: 80 columns
against a projection's thousands) that is a few percent of the base matmul; a sort-by-slot
segment kernel is the better shape past a few hundred columns. At the tiny LLaVA's width (64)
the apply's cost is its launches, not its multiply-adds (benchmarks/README.md's LoRA section).

Invariants:
- A base row (slot 0) gets exactly the base output: its mask row is zero, and a step with no
  adapter row (:attr:`LoRARows.active` false), or a layer that none of the step's adapters
  touches (no slot of :attr:`LoRARows.slots` loaded in it), skips the delta entirely
  (base-only batches pay nothing).
- ``base`` is whatever module computed the projection (``torch.nn.Linear``, the CPU's
  :class:`~mmis.engine.execution.cpu_linear.PackedLinear`): the wrapper only adds the delta to
  its output, so packing may happen before or after wrapping.
- Loading slot ``s`` writes that slot's rows only (zeroing its padding); clearing writes zeros.
- Under tensor parallelism (``engine/execution/tensor_parallel.py``) a wrapped projection holds
  this rank's share, the way the engine splits the base: a column-parallel projection (its
  ``shard`` ``dim == "out"``: q/k/v, gate/up) keeps ``B``'s output rows ``lo:hi`` and the whole
  ``A``; a row-parallel one (``dim == "in"``: o/down, a ``RowParallelLinear``) keeps ``A``'s
  input columns ``lo:hi`` and the whole ``B``, and its delta is added to the partial output
  *before* the base's all-reduce (``sum_r (x_r A_r^T) B = x A^T B``: no extra collective).
  ``in_features`` / ``out_features`` stay the unsplit sizes (what an adapter is checked
  against); :func:`buffer_bytes` is what one wrapper allocates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch


class Shard(Protocol):
    """This rank's share of a projection (``tensor_parallel.Shard``): ``dim`` ``"out"`` (output
    rows ``lo:hi``) or ``"in"`` (input columns ``lo:hi``) of ``full``."""

    dim: str
    lo: int
    hi: int
    full: int


def buffer_bytes(n_in: int, n_out: int, slots: int, max_rank: int, dtype: torch.dtype) -> int:
    """Bytes of one wrapper's ``A`` and ``B`` buffers (``n_in`` / ``n_out``: this rank's)."""
    return slots * max_rank * (n_in + n_out) * dtype.itemsize


def grouped_lora_delta(
    x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """The LoRA delta of every row of ``x`` ``[..., in]`` under its own slot: ``a``
    ``[S, r, in]``, ``b_t`` ``[S, r, out]`` (scaled), ``mask`` ``[..., S * r]`` (each row's
    one-hot slot repeated ``r`` times: :meth:`LoRARows.flat_mask`), broadcastable against
    ``x``'s leading dimensions."""
    slots, rank, _ = a.shape
    h = torch.nn.functional.linear(x, a.view(slots * rank, -1)).mul_(mask)
    return h @ b_t.view(slots * rank, -1)


class LoRARows:
    """Which slot each row of the next forward uses, shared by every :class:`LoRALinear` of one
    part of the model (the language model's rows, or the vision tower's).

    After :meth:`select`: :attr:`active` (some row has an adapter), :attr:`slots` (the step's
    adapter slots, 0 excluded), :attr:`single` (the slot when there is exactly one, else None),
    :attr:`index` (each row's slot on the device, ``[rows, 1 * trailing]``) and :attr:`mask`
    (with :attr:`single`: each row's 0/1 ``[rows, 1 * trailing, 1]``, None when every row has
    that slot; else None and :meth:`flat_mask` builds the grouped mask once per rank)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.active = False
        self.slots: frozenset[int] = frozenset()
        self.single: int | None = None
        self.index: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        self._flat: dict[int, torch.Tensor] = {}
        self._tables: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
        self._dtype = torch.float32

    def select(
        self,
        slots: Sequence[int],
        *,
        repeats: Sequence[int] | None = None,
        trailing: int = 0,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        """Set each row's slot (0: none): ``slots[i]`` for ``repeats[i]`` consecutive rows
        (one row each without ``repeats``: a sequence's slot for each of its tokens).
        ``trailing`` is the number of dimensions between the row and the features that share
        the row's slot (1 for a vision tower's ``[images, patches, in]`` with one slot per
        image; 0 for flattened tokens). One upload of the row index; nothing reads back."""
        present = set(slots)
        if min(present, default=0) < 0 or max(present, default=0) >= self.num_slots:
            raise ValueError(f"LoRA slots must be within [0, {self.num_slots}), got {slots}")
        if repeats is not None and (len(repeats) != len(slots) or min(repeats, default=0) < 0):
            raise ValueError(f"LoRA row counts {repeats} do not match the slots {slots}")
        self._flat = {}
        self.slots = frozenset(present - {0})
        self.active = bool(self.slots)
        if not self.active:
            self.single = self.index = self.mask = None
            return
        self.single = next(iter(self.slots)) if len(self.slots) == 1 else None
        per_row = np.asarray(slots, dtype=np.int64)
        if repeats is not None:
            per_row = np.repeat(per_row, np.asarray(repeats, dtype=np.int64))
        shape = (per_row.shape[0], *([1] * trailing))
        index = torch.from_numpy(per_row).to(device, non_blocking=True).view(shape)
        self.index, self._dtype = index, dtype
        self.mask = None
        if self.single is not None and 0 in present:  # base rows beside the one adapter
            self.mask = (index == self.single).to(dtype).unsqueeze(-1)

    def flat_mask(self, rank: int) -> torch.Tensor:
        """``[rows, 1 * trailing, S * rank]``: each row's one-hot slot repeated ``rank`` times
        (column ``j`` belongs to slot ``j // rank``); built once per step, by one row lookup in
        a table made once per rank, dtype and device."""
        mask = self._flat.get(rank)
        if mask is None:
            index = self.index
            if index is None:
                raise RuntimeError("LoRARows.flat_mask before a select with adapter rows")
            key = (rank, self._dtype, index.device)
            table = self._tables.get(key)
            if table is None:  # [S, S * rank]: row s is slot s's columns
                columns = torch.arange(self.num_slots * rank, device=index.device) // rank
                slots = torch.arange(self.num_slots, device=index.device).unsqueeze(-1)
                table = self._tables[key] = (slots == columns).to(self._dtype)
            mask = table.index_select(0, index.view(-1)).view(*index.shape, -1)
            self._flat[rank] = mask
        return mask

    def clear(self) -> None:
        self.active, self.slots, self.single = False, frozenset(), None
        self.index = self.mask = None
        self._flat = {}


def local_features(base: torch.nn.Module) -> tuple[int, int]:
    """``(in, out)`` of ``base`` as this rank holds it."""
    features: tuple[int, int] = (base.in_features, base.out_features)  # type: ignore[assignment]
    return int(features[0]), int(features[1])


def full_features(base: torch.nn.Module, shard: Shard | None) -> tuple[int, int]:
    """``(in, out)`` of ``base`` before the tensor-parallel split (what adapters match)."""
    n_in, n_out = local_features(base)
    if shard is None:
        return n_in, n_out
    if shard.hi - shard.lo != (n_out if shard.dim == "out" else n_in):
        raise ValueError(f"shard {shard} does not match the projection's {n_in}->{n_out}")
    return (n_in, shard.full) if shard.dim == "out" else (shard.full, n_out)


class LoRALinear(torch.nn.Module):
    """``base(x)`` plus each row's adapter delta (see the module docstring)."""

    lora_a: torch.Tensor  # [slots, max_rank, in]
    lora_b_t: torch.Tensor  # [slots, max_rank, out], scaled

    def __init__(
        self,
        base: torch.nn.Module,
        rows: LoRARows,
        max_rank: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        shard: Shard | None = None,
    ) -> None:
        super().__init__()
        self.base = base
        self.rows = rows
        self.shard = shard
        local_in, local_out = local_features(base)
        self.in_features, self.out_features = full_features(base, shard)
        weight = getattr(base, "weight", None)  # a PackedLinear has none: dtype/device given
        if isinstance(weight, torch.Tensor):
            dtype, device = dtype or weight.dtype, device or weight.device
        dtype, device = dtype or torch.float32, device or torch.device("cpu")
        slots = rows.num_slots
        self.register_buffer(
            "lora_a", torch.zeros(slots, max_rank, local_in, dtype=dtype, device=device)
        )
        self.register_buffer(
            "lora_b_t", torch.zeros(slots, max_rank, local_out, dtype=dtype, device=device)
        )
        self.loaded: set[int] = set()  # slots holding weights for this module

    def set_slot(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Load ``a`` ``[r, in]`` and scaled ``b`` ``[out, r]`` (unsplit) into ``slot`` (>= 1);
        under tensor parallelism this rank's share of them (module docstring)."""
        if slot < 1:
            raise ValueError("slot 0 is the no-adapter slot and stays zero")
        if self.shard is not None and self.shard.dim == "out":
            b = b[self.shard.lo : self.shard.hi]
        elif self.shard is not None:
            a = a[:, self.shard.lo : self.shard.hi]
        rank = a.shape[0]
        self.lora_a[slot].zero_()
        self.lora_b_t[slot].zero_()
        self.lora_a[slot, :rank].copy_(a)
        self.lora_b_t[slot, :rank].copy_(b.t())
        self.loaded.add(slot)

    def clear_slot(self, slot: int) -> None:
        if slot in self.loaded:
            self.lora_a[slot].zero_()
            self.lora_b_t[slot].zero_()
            self.loaded.discard(slot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.rows
        if not rows.active or self.loaded.isdisjoint(rows.slots):
            out: torch.Tensor = self.base(x)
            return out
        if self.shard is not None and self.shard.dim == "in":  # before the all-reduce
            split: Any = self.base  # tensor_parallel.RowParallelLinear
            partial: torch.Tensor = self._add_delta(split.partial(x), x)
            finished: torch.Tensor = split.finish(partial)
            return finished
        return self._add_delta(self.base(x), x)

    def _add_delta(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out`` (the base's output for ``x``) plus each row's delta, in place when it can."""
        rows, a, b_t = self.rows, self.lora_a, self.lora_b_t
        slots, rank, _ = a.shape
        if rows.single is not None:  # one adapter: its own rank-r pair
            a, b_t = a[rows.single], b_t[rows.single]
            h = torch.nn.functional.linear(x, a)
            if rows.mask is not None:
                h.mul_(rows.mask)
        else:
            a, b_t = a.view(slots * rank, -1), b_t.view(slots * rank, -1)
            h = torch.nn.functional.linear(x, a).mul_(rows.flat_mask(rank))
        if out.dtype == h.dtype and out.is_contiguous():
            out.view(-1, out.shape[-1]).addmm_(h.view(-1, h.shape[-1]), b_t)
            return out
        return out + (h @ b_t).to(out.dtype)

    def extra_repr(self) -> str:
        return f"slots={self.rows.num_slots}, max_rank={self.lora_a.shape[1]}"
