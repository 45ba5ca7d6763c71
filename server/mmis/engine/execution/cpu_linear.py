"""P1's language-model linears on CPU: oneDNN with prepacked weights where it measures faster.

PyTorch's ``F.linear`` on CPU runs float32 through MKL's sgemm; at decode sizes (a few dozen
rows) that leaves much of some CPUs unused (AMD EPYC Zen 4, 1 thread, 16 x 896 x 4864: 39
GFLOP/s against oneDNN's 72 with the weight prepacked; on an Intel Xeon the two were equal).
:func:`pack_linears` (``--cpu-linear``, :data:`CHOICES`) replaces the ``torch.nn.Linear``
modules of the decoder layers and the LM head by :class:`PackedLinear`, which holds the
weight once, reordered into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``)
and computes with ``torch.ops.mkldnn._linear_pointwise``: both ship in every x86 PyTorch
build, no extra dependency (vLLM's CPU build prepacks its linears into oneDNN the same way).

Invariants:
- ``auto`` decides per weight shape, by measurement on this machine at start-up
  (:func:`onednn_faster`: best of a few runs at :data:`DECODE_ROWS` and :data:`PREFILL_ROWS`
  rows, fewer where one call would exceed :data:`MEASURE_FLOPS`; with the engine's threads);
  ``onednn`` packs every one, ``torch`` none. Every shape is decided (and, for ``onednn``, run
  once) before any module is swapped, so a missing or failing oneDNN op leaves every module as
  it was (logged) and the choice never breaks a start-up. A bfloat16 or float16 model on a CPU
  where oneDNN has no path for that dtype (:func:`onednn_supports`: bfloat16 needs
  AVX512-BW/VL/DQ or AVX-NE-CONVERT, float16 AVX512-FP16 or AVX-NE-CONVERT) keeps every
  module, and the log line says so. Modules are then swapped one at a time, so packing holds
  at most one extra weight (the first module of each shape is therefore packed twice, once to
  decide and once to swap: a weight copy per shape, not a weight kept per shape). Only CPU
  models are touched; CUDA keeps ``F.linear``.
- A packed module computes what the linear did (same dtype, bias added by the op) and keeps no
  copy of the unpacked weight; a weight tied to another module (the LM head and the input
  embeddings) stays alive through that module. The vision tower is not touched: it runs large
  prefill-sized matmuls, where the two libraries are close, and transformers reads some of its
  weights' dtype (``engine/execution/model/``'s families).
- Tensor parallelism packs after splitting (``engine/execution/tensor_parallel.py``): the row-split
  linears are ordinary linears then;
  :class:`~mmis.engine.execution.tensor_parallel.RowParallelLinear` stays as it is.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from mmis.engine.config import CPU_LINEAR_CHOICES as CHOICES
from mmis.engine.execution.timing import best_time

log = logging.getLogger(__name__)

DECODE_ROWS = 16  # rows of the decode-sized measurement
PREFILL_ROWS = 256  # rows of the prefill-sized measurement (at most)
MEASURE_FLOPS = 2**30  # one timed call's FLOPs at most, so start-up stays short
REPEAT = 3  # timed runs per variant and row count (best taken), after one warm-up


def _reorder(weight: torch.Tensor, batch: list[int] | None) -> torch.Tensor:
    """``weight`` in oneDNN's blocked layout (an opaque ``torch._mkldnn`` tensor)."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, batch)
    return packed


class PackedLinear(torch.nn.Module):
    """A ``torch.nn.Linear`` whose weight lives prepacked for oneDNN (see the docstring)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # an opaque oneDNN tensor: not a parameter, never moved or saved
        self.packed = _reorder(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, "none", [], ""
        )
        return out

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


@dataclass
class PackReport:
    """What :func:`pack_linears` did, for the start-up log line."""

    mode: str
    packed: int = 0
    kept: int = 0
    speedups: dict[tuple[int, int], float] = field(default_factory=dict)  # (in, out): torch/oneDNN
    error: str | None = None

    def describe(self) -> str:
        if self.error is not None:
            return f"torch for all {self.kept} (oneDNN unusable: {self.error})"
        text = f"oneDNN prepacked for {self.packed} of {self.packed + self.kept} ({self.mode})"
        if self.speedups:
            shown = ", ".join(f"{i}x{o} x{s:.2f}" for (i, o), s in sorted(self.speedups.items()))
            text += f"; measured oneDNN speed-up by shape: {shown}"
        return text


def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack and run linears of ``dtype`` on this CPU."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32


def measured_rows(linear: torch.nn.Linear) -> tuple[int, ...]:
    """The row counts :func:`onednn_faster` times: :data:`DECODE_ROWS`, and
    :data:`PREFILL_ROWS` cut so one call stays within :data:`MEASURE_FLOPS` (a large
    vocabulary's LM head is timed at decode size only)."""
    cap = MEASURE_FLOPS // (2 * linear.in_features * linear.out_features)
    prefill = max(DECODE_ROWS, min(PREFILL_ROWS, cap))
    return (DECODE_ROWS,) if prefill == DECODE_ROWS else (DECODE_ROWS, prefill)


def onednn_faster(linear: torch.nn.Linear, packed: PackedLinear) -> float:
    """The measured speed-up of ``packed`` over ``linear`` on this machine: ``F.linear``'s
    time over oneDNN's, summed over a decode-sized and a prefill-sized batch of rows
    (:func:`measured_rows`)."""
    plain = packed_time = 0.0
    with torch.inference_mode():
        for rows in measured_rows(linear):
            x = torch.randn(rows, linear.in_features, dtype=linear.weight.dtype)
            plain += best_time(functools.partial(linear, x), REPEAT)
            packed_time += best_time(functools.partial(packed, x), REPEAT)
    return plain / packed_time


def _targets(
    model: torch.nn.Module, layers: torch.nn.Module
) -> Iterator[tuple[torch.nn.Module, str]]:
    """(parent, attribute) of every linear of the decoder layers, then the LM head."""
    for parent in layers.modules():
        for name, child in parent.named_children():
            if type(child) is torch.nn.Linear:
                yield parent, name
    if type(getattr(model, "lm_head", None)) is torch.nn.Linear:
        yield model, "lm_head"


def pack_linears(model: torch.nn.Module, layers: torch.nn.Module, mode: str) -> PackReport:
    """Replace the linears of ``layers`` (the decoder layers) and ``model.lm_head`` by
    :class:`PackedLinear` as ``mode`` says (:data:`CHOICES`; see the module docstring)."""
    if mode not in CHOICES:
        raise ValueError(f"--cpu-linear must be one of {', '.join(CHOICES)}, got {mode!r}")
    report = PackReport(mode)
    targets = list(_targets(model, layers))
    on_cpu = all(getattr(p, n).weight.device.type == "cpu" for p, n in targets)
    if mode == "torch" or not targets or not on_cpu:
        report.kept = len(targets)
        return report
    dtypes = {getattr(p, n).weight.dtype for p, n in targets}
    unsupported = sorted(str(d).removeprefix("torch.") for d in dtypes if not onednn_supports(d))
    if unsupported:
        report.kept = len(targets)
        report.error = f"no {'/'.join(unsupported)} path on this CPU"
        return report
    # 1. decide per shape, on the first module of each (nothing is swapped yet)
    decided: dict[tuple[int, int, torch.dtype], bool] = {}
    try:
        for parent, name in targets:
            linear = getattr(parent, name)
            key = (linear.in_features, linear.out_features, linear.weight.dtype)
            if key in decided:
                continue
            packed = PackedLinear(linear)
            if mode == "auto":
                speedup = onednn_faster(linear, packed)
                report.speedups[key[:2]] = speedup
                decided[key] = speedup > 1.0
            else:  # fail here, not in the first step, where oneDNN has no kernel
                packed(torch.zeros(1, linear.in_features, dtype=linear.weight.dtype))
                decided[key] = True
            del packed
    except (RuntimeError, AttributeError) as exc:  # no oneDNN in this build, or no kernel
        report.kept, report.error = len(targets), f"{type(exc).__name__}: {exc}"
        return report
    # 2. swap one module at a time: its unpacked weight is freed before the next is packed
    for parent, name in targets:
        linear = getattr(parent, name)
        if decided[(linear.in_features, linear.out_features, linear.weight.dtype)]:
            setattr(parent, name, PackedLinear(linear))
            report.packed += 1
        else:
            report.kept += 1
    return report


def pack_adapter(adapter: Any, mode: str) -> PackReport:
    """:func:`pack_linears` over a model adapter's decoder layers and LM head, logged."""
    report = pack_linears(adapter.model, adapter.language_model.layers, mode)
    log.info("cpu linear: %s", report.describe())
    return report
