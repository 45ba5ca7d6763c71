"""The LoRA projection: a wrapper around a linear holding every device slot's weights, and the
grouped apply over a batch's rows.

Design (after studying vLLM's punica ``bgmv``/``sgmv`` and SGLang's segment GEMMs; no code
copied): a layer with ``S = max_loras + 1`` slots holds ``A`` as ``[S, r_max, in]`` and ``B``
transposed per slot, ``[S, r_max, out]`` (so both flatten to one matrix without a copy); ranks
below ``r_max`` are zero-padded and slot 0 is all zeros (no adapter). For the rows ``x``
``[..., in]`` and a per-row one-hot ``mask`` ``[..., S, 1]`` (set once per forward on the
shared :class:`LoRARows`), :func:`grouped_lora_delta` computes

    delta = ((x @ A_flat^T).view(..., S, r_max) * mask).view(..., S * r_max) @ B_flat

two GEMMs per projection whatever the mix of adapters (one launch each, fixed shapes, so CUDA
graphs can capture it), never a loop over adapters. It spends ``S * r_max`` columns where a
gather would spend ``r_max``: at vLLM's defaults (4 adapters, rank 16: 80 columns against a
projection's thousands) that is a few percent of the base matmul; a sort-by-slot segment kernel
is the better shape past a few hundred columns.

Invariants:
- A base row (slot 0) gets exactly the base output: its mask row is zero, and a step with no
  adapter row (:attr:`LoRARows.active` false) or a layer no resident adapter touches skips the
  delta entirely (base-only batches pay nothing).
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

from typing import Any, Protocol

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
    ``[S, r, in]``, ``b_t`` ``[S, r, out]`` (scaled), ``mask`` one-hot ``[..., S, 1]``
    broadcastable against ``[..., S, r]``."""
    slots, rank, _ = a.shape
    h = torch.nn.functional.linear(x, a.reshape(slots * rank, -1))
    h = (h.unflatten(-1, (slots, rank)) * mask).flatten(-2)
    return h @ b_t.reshape(slots * rank, -1)


class LoRARows:
    """Which slot each row of the next forward uses, shared by every :class:`LoRALinear` of one
    part of the model (the language model's rows, or the vision tower's)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.mask: torch.Tensor | None = None
        self.active = False

    def select(
        self,
        slots: list[int],
        *,
        trailing: int = 0,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        """Set each row's slot (0: none). ``trailing`` is the number of dimensions between the
        row and the features that share the row's slot (1 for a vision tower's ``[images,
        patches, in]`` with one slot per image; 0 for flattened tokens)."""
        if any(s < 0 or s >= self.num_slots for s in slots):
            raise ValueError(f"LoRA slots must be within [0, {self.num_slots}), got {slots}")
        self.active = any(slots)
        if not self.active:
            self.mask = None
            return
        index = torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True)
        mask = torch.nn.functional.one_hot(index, self.num_slots).to(dtype)
        self.mask = mask.view(len(slots), *([1] * trailing), self.num_slots, 1)

    def clear(self) -> None:
        self.mask, self.active = None, False


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
        mask = self.rows.mask
        if not self.loaded or mask is None:
            out: torch.Tensor = self.base(x)
            return out
        delta = grouped_lora_delta(x, self.lora_a, self.lora_b_t, mask)
        if self.shard is not None and self.shard.dim == "in":  # before the all-reduce
            split: Any = self.base  # tensor_parallel.RowParallelLinear
            partial: torch.Tensor = split.partial(x)
            finished: torch.Tensor = split.finish(partial + delta.to(partial.dtype))
            return finished
        out = self.base(x)
        return out + delta.to(out.dtype)

    def extra_repr(self) -> str:
        return f"slots={self.rows.num_slots}, max_rank={self.lora_a.shape[1]}"
