"""Fused projections (and, through ``model/norms.py`` and ``model/rotary.py``, norms and
rotary embeddings) for the unmodified Hugging Face decoder layers, made at load.

A decoder layer of every family here computes ``q_proj(h)``, ``k_proj(h)``, ``v_proj(h)`` on the
same tensor, and ``gate_proj(x)``, ``up_proj(x)`` on the same tensor: three and two matmuls
(three and two kernel launches, three and two reads of ``h``) where one would do.
:func:`fuse_adapter` (called by :meth:`ModelAdapter.load`, ``model/adapter.py``) merges each
group's weights into one ``torch.nn.Linear`` (rows concatenated, biases too: Qwen2's q/k/v
biases) held by a :class:`FusedProjection`, and puts a :class:`FusedPart` in each sibling's
place (on CUDA by default: a CPU load keeps its linears, see :func:`fuse_adapter`). The
modeling code is not touched: it still calls ``self.q_proj(h)`` and gets the same
``[..., out_features]`` tensor, now a view of the one fused product; what it does next (Gemma 3's
``q_norm``/``k_norm``, the activation) is unchanged and runs in its order; only the modeling
module's ``apply_rotary_pos_emb`` is swapped for one that gives the same result (below).

On a device where torch has a fused RMSNorm kernel it also replaces the language model's
RMSNorm modules (``model/norms.py``); on CUDA, Gemma's norms, which ``rms_norm`` cannot
take in bfloat16, run as compiled kernels (``model/compiled.py``). Torch has no fused
residual-add + RMSNorm nor SiLU-and-mul in the supported range, so those stay as
transformers runs them. With q and k
one product, their rotary embeddings run as one (``model/rotary.py``: four kernels for both
instead of ten, bit for bit transformers' result), and so do Gemma 3's q_norm and k_norm that
come between (``model/norms.py``, :func:`fuse_qk_norms`).

Invariants:
- A :class:`FusedPart` returns what its original linear returned for the same input: same
  shape and dtype, and the same values up to the matmul's rounding (each output column comes
  from the same row of weights and the same input, but a GEMM of another width may sum in
  another order; the tiny models' logits came out bit-equal on CPU, float32 and bfloat16).
  The fused product of an input is reused by a sibling
  only when the sibling is called with the *same tensor object* (the group holds a strong
  reference to it, so its ``id`` cannot be recycled), with the same data pointer, shape, strides
  and dtype, and, for a tensor that has a version counter (not an inference tensor), the same
  ``_version`` (no in-place write since). Each part is handed out once per product: a part asked
  for again, or any part for another input, recomputes. The product and the input are dropped
  as soon as every part has been handed out. A different input can therefore never get a slice
  of an earlier input's product. (An inference tensor has no version counter: an in-place write
  to the input *between* the sibling calls of one attention or MLP forward would not be seen;
  the modeling code of every family here calls the siblings back to back on the same tensor.)
- Fusion never doubles the weights' memory: each group is concatenated and the original
  modules are dropped before the next group is made (one group's weights extra at most).
- A group is fused only when every member is a plain ``torch.nn.Linear`` with the same input
  width, dtype and device, and either all or none have a bias; any other group stays as it
  was (counted in the report).
- Tensor parallelism (``engine/execution/tensor_parallel.py``) splits the unfused modules:
  ``shard_adapter`` calls :func:`unfuse_projections` first (each part a view of the fused
  weight: no copy) and :func:`fuse_projections` after, so each rank fuses its own rows.
- ``engine/execution/cpu_linear.py`` packs the fused ``torch.nn.Linear`` (a child of the
  :class:`FusedProjection`, reached once however many parts share it) like any other linear.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from mmis.engine.execution.model.norms import (
    FusedRMSNorm,
    fuse_norms,
    fuse_qk_norms,
    fused_norm_kernel,
)
from mmis.engine.execution.model.rotary import fuse_rotary

log = logging.getLogger(__name__)

ATTENTION_GROUP = ("q_proj", "k_proj", "v_proj")
MLP_GROUP = ("gate_proj", "up_proj")


class FusedProjection(torch.nn.Module):
    """One linear computing several sibling projections of one input (see the docstring)."""

    def __init__(self, linear: torch.nn.Module, sizes: Sequence[int]) -> None:
        super().__init__()
        self.linear = linear
        self.sizes = tuple(int(s) for s in sizes)
        spans, lo = [], 0
        for size in self.sizes:
            spans.append((lo, size))
            lo += size
        self.spans = tuple(spans)
        self.all_parts = (1 << len(self.sizes)) - 1
        # (input, its data pointer, shape, version, fused product, parts not yet handed out as
        # a bit mask) while a product is shared, else None
        self._state: tuple[torch.Tensor, int, torch.Size, int | None, torch.Tensor, int] | None
        self._state = None

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Part ``index`` of the fused product of ``x``: reused from a sibling's call on the
        same, unchanged tensor, else computed (for every part) now."""
        bit = 1 << index
        state = self._state
        version = None if x.is_inference() else x._version
        if (
            state is not None
            and state[0] is x
            and state[5] & bit
            and state[3] == version
            and state[1] == x.data_ptr()
            and state[2] == x.shape
        ):
            output, pending = state[4], state[5] & ~bit
        else:
            # the linear's forward itself: no module-call overhead (packing may replace it)
            linear: Any = self._modules["linear"]
            output, pending = linear.forward(x), self.all_parts & ~bit
        # every part handed out: nothing of this input is kept
        self._state = (x, x.data_ptr(), x.shape, version, output, pending) if pending else None
        lo, size = self.spans[index]
        return output.narrow(-1, lo, size)

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}"


class FusedPart(torch.nn.Module):
    """Stands in for one sibling linear: its slice of a :class:`FusedProjection`."""

    def __init__(self, group: FusedProjection, index: int, name: str) -> None:
        super().__init__()
        self.group = group
        self.__dict__["_part"] = group.part  # a plain attribute: no module lookup per call
        self.index = index
        self.name = name
        self.in_features = _in_features(group.linear)
        self.out_features = group.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part: Callable[[int, torch.Tensor], torch.Tensor] = self.__dict__["_part"]
        return part(self.index, x)

    def extra_repr(self) -> str:
        return f"{self.name}: part {self.index} of {self.group.sizes}"


def _in_features(linear: torch.nn.Module) -> int:
    return int(getattr(linear, "in_features"))  # noqa: B009 (a Linear or a packed linear)


def _fusable(linears: Sequence[Any]) -> bool:
    if not all(type(m) is torch.nn.Linear for m in linears):
        return False
    first = linears[0].weight
    same = all(
        m.in_features == linears[0].in_features
        and m.weight.dtype == first.dtype
        and m.weight.device == first.device
        for m in linears
    )
    biases = {m.bias is None for m in linears}
    return same and len(biases) == 1


def fuse_group(parent: torch.nn.Module, names: Sequence[str]) -> bool:
    """Merge ``parent``'s linears ``names`` into one :class:`FusedProjection`; False (nothing
    changed) where they cannot be fused."""
    found = [getattr(parent, n, None) for n in names]
    linears: list[Any] = [m for m in found if m is not None]
    if len(linears) != len(names) or not _fusable(linears):
        return False
    weight = torch.cat([m.weight.detach() for m in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([m.bias.detach() for m in linears]) if has_bias else None
    first = linears[0]
    fused = torch.nn.Linear(
        first.in_features,
        weight.shape[0],
        bias=has_bias,
        device=weight.device,
        dtype=weight.dtype,
    )
    fused.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = torch.nn.Parameter(bias, requires_grad=False)
    group = FusedProjection(fused, [m.out_features for m in linears])
    for i, name in enumerate(names):
        setattr(parent, name, FusedPart(group, i, name))
    return True


def unfuse_group(parent: torch.nn.Module, names: Sequence[str]) -> bool:
    """Put plain linears back for a fused group (each weight a view of the fused one: no
    copy); False where the group is not fused."""
    parts = [getattr(parent, n, None) for n in names]
    if not all(isinstance(p, FusedPart) for p in parts):
        return False
    group = parts[0].group  # type: ignore[union-attr]
    fused = group.linear
    if type(fused) is not torch.nn.Linear:
        raise TypeError(f"cannot unfuse {names}: the fused linear is a {type(fused).__name__}")
    for i, name in enumerate(names):
        lo, size = group.spans[i]
        hi = lo + size
        linear = torch.nn.Linear(
            fused.in_features,
            hi - lo,
            bias=fused.bias is not None,
            device="meta",
            dtype=fused.weight.dtype,
        )
        linear.weight = torch.nn.Parameter(fused.weight.detach()[lo:hi], requires_grad=False)
        if fused.bias is not None:
            linear.bias = torch.nn.Parameter(fused.bias.detach()[lo:hi], requires_grad=False)
        setattr(parent, name, linear)
    return True


def _groups(layers: Iterable[torch.nn.Module]) -> list[tuple[torch.nn.Module, tuple[str, ...]]]:
    found: list[tuple[torch.nn.Module, tuple[str, ...]]] = []
    for layer in layers:
        for attr, names in (("self_attn", ATTENTION_GROUP), ("mlp", MLP_GROUP)):
            parent = getattr(layer, attr, None)
            if isinstance(parent, torch.nn.Module):
                found.append((parent, names))
    return found


def fuse_projections(layers: Iterable[torch.nn.Module]) -> tuple[int, int]:
    """Fuse every decoder layer's q/k/v and gate/up; returns (fused, kept) group counts."""
    fused = kept = 0
    for parent, names in _groups(layers):
        if all(isinstance(getattr(parent, n, None), FusedPart) for n in names):
            fused += 1  # already fused (a second call is a no-op)
        elif fuse_group(parent, names):
            fused += 1
        else:
            kept += 1
    return fused, kept


def unfuse_projections(layers: Iterable[torch.nn.Module]) -> bool:
    """Undo :func:`fuse_projections` (for tensor parallelism's split); True if any was fused."""
    found = False
    for parent, names in _groups(layers):
        found = unfuse_group(parent, names) or found
    return found


@dataclasses.dataclass
class FuseReport:
    """What :func:`fuse_adapter` did, for the start-up log."""

    groups: int = 0
    groups_kept: int = 0
    norms: int = 0
    norms_kept: int = 0
    qk_norms: int = 0
    qk_norms_kept: int = 0
    rotary: int = 0
    rotary_kept: int = 0
    compiled: bool = False

    def describe(self) -> str:
        return (
            f"fused q/k/v and gate/up in {self.groups} groups ({self.groups_kept} kept); "
            f"torch rms_norm for {self.norms} norms ({self.norms_kept} kept"
            f"{'; Gemma-style ones compiled' if self.compiled else ''}); "
            f"joint q/k norms in {self.qk_norms} layers ({self.qk_norms_kept} kept); "
            f"joint q/k rotary in {self.rotary} modeling modules ({self.rotary_kept} kept)"
        )


def fuse_adapter(
    adapter: Any,
    *,
    projections: bool | None = None,
    norms: bool | None = None,
    rotary: bool | None = None,
    compiled: bool | None = None,
) -> FuseReport:
    """Fuse a model adapter's language model in place (see the module docstring), logged.
    ``projections``: merge q/k/v and gate/up (default: on CUDA only, where one launch less per
    group is the point; on CPU the tiny models' decode step measured ~5% slower fused, 1.69 ->
    1.78 ms, so a CPU load keeps its linears as they were, ``benchmarks/README.md``).
    ``norms``: replace the RMSNorms too (default: where :func:`fused_norm_kernel` says so for
    the adapter's device). ``rotary``: q and k's rotary embeddings as one
    (``model/rotary.py``; default: wherever q/k/v were fused, the only place it applies).
    ``compiled``: Gemma's norms as compiled kernels (``model/compiled.py``; default: on CUDA,
    where each is one launch instead of three; a CPU load keeps transformers' norms anyway)."""
    lm = adapter.language_model
    report = FuseReport()
    if projections is None:
        projections = torch.device(adapter.device).type == "cuda"
    if projections:
        report.groups, report.groups_kept = fuse_projections(lm.layers)
    if norms is None:
        norms = fused_norm_kernel(torch.device(adapter.device))
    attention = [a for layer in lm.layers if (a := getattr(layer, "self_attn", None)) is not None]
    if compiled is None:
        compiled = torch.device(adapter.device).type == "cuda"
    if norms:
        report.norms, report.norms_kept = fuse_norms(lm, compiled=compiled)
        # said in the log only where a Gemma-style norm takes the compiled path
        report.compiled = compiled and any(
            isinstance(m, FusedRMSNorm) and m.gemma for m in lm.modules()
        )
        if report.groups > 0:  # q_norm/k_norm over a fused product: one pass (model/norms.py)
            report.qk_norms, report.qk_norms_kept = fuse_qk_norms(attention)
    if rotary is None:
        rotary = report.groups > 0
    if rotary:
        report.rotary, report.rotary_kept = fuse_rotary(attention)
    log.info("fused layers: %s", report.describe())
    return report
