"""Transformers' RMSNorm modules as ``torch.nn.functional.rms_norm``, made at load.

On a device where torch has a fused RMSNorm kernel (CUDA: :func:`fused_norm_kernel`),
:func:`fuse_norms` (called by ``model/fused.py``'s ``fuse_adapter``) replaces the RMSNorm
modules of the language model by :class:`FusedRMSNorm`, which calls
``torch.nn.functional.rms_norm`` (``aten::_fused_rms_norm``: one CUDA kernel on every supported
torch, where transformers' Python RMSNorm launches about eight, with float32 upcasts). On CPU
torch decomposes that op into the same ops transformers runs, with more dispatch overhead
(measured ~10-25 us a norm slower on the tiny models), so CPU models keep transformers' norms.

Invariants:
- A norm is replaced only if its class is a known transformers RMSNorm (:data:`LLAMA_STYLE`:
  ``weight * normed.to(dtype)``; :data:`GEMMA_STYLE`: ``(normed * (1 + weight)).to(dtype)`` in
  float32) and a probe at load finds the replacement equal to the module on a random input
  (same dtype, values within :func:`probe_tolerance`); otherwise that class is kept. In float32
  the replacement is the same arithmetic (torch's CPU decomposition is transformers' op
  sequence); in bfloat16/float16 the Llama style rounds once instead of twice (at most one ulp
  of the dtype per element). A norm's output keeps its input's dimension order in memory (a
  transposed view is normalised through its memory order, :func:`memory_order`), as
  transformers' elementwise ops do, so the attention output's later reshape stays a view.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# RMSNorm classes of transformers by arithmetic (see the module docstring)
LLAMA_STYLE = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen2VLRMSNorm", "Qwen2_5_VLRMSNorm"})
GEMMA_STYLE = frozenset({"Gemma3RMSNorm"})


class FusedRMSNorm(torch.nn.Module):
    """A transformers RMSNorm computed by ``torch.nn.functional.rms_norm`` (one kernel on
    CUDA). ``gemma``: Gemma's ``(1 + weight)`` scale, applied in float32 like Gemma 3 does."""

    def __init__(self, norm: torch.nn.Module, *, gemma: bool) -> None:
        super().__init__()
        weight = _weight(norm).detach()
        self.gemma = gemma
        self.eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        self.shape = (int(weight.shape[-1]),)
        self.original = type(norm).__name__
        if gemma:  # (1 + w) once, in float32, as Gemma3RMSNorm computes it per call
            weight = 1.0 + weight.float()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms_norm = torch.nn.functional.rms_norm
        order = memory_order(x)
        if order is not None:  # normalise in memory order: one dense copy at most, no transpose
            x = x.permute(order)
        if self.gemma:
            out = rms_norm(x.float(), self.shape, self.weight, self.eps).to(x.dtype)
        else:
            out = rms_norm(x, self.shape, self.weight, self.eps)
        if order is None:
            return out
        inverse = [0] * len(order)
        for i, d in enumerate(order):
            inverse[d] = i
        return out.permute(inverse)

    def extra_repr(self) -> str:
        return f"{self.shape}, eps={self.eps}, from {self.original}"


def memory_order(x: torch.Tensor) -> list[int] | None:
    """The permutation putting ``x``'s dimensions in memory order (largest stride first, the
    last dimension kept last), or None where that is already their order: a norm over the last
    dimension of a transposed view (Gemma 3's ``q_norm`` on ``[1, heads, n, head_dim]``) then
    reads rows as they lie and returns the same dimension order as transformers' elementwise
    norm did, so no later reshape has to copy."""
    last = x.dim() - 1
    if last < 1 or x.is_contiguous() or x.stride(-1) != 1:
        return None
    strides = x.stride()
    order = [*sorted(range(last), key=lambda d: -strides[d]), last]
    return None if order == list(range(x.dim())) else order


def probe_tolerance(dtype: torch.dtype) -> float:
    """The probe's absolute and relative tolerance: a few ulps of ``dtype``."""
    return 4 * float(torch.finfo(dtype).eps)


def _weight(norm: torch.nn.Module) -> torch.Tensor:
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(norm).__name__} has no weight tensor")
    return weight


def _probe(norm: torch.nn.Module, fused: FusedRMSNorm) -> bool:
    weight = _weight(norm)
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(3, fused.shape[0], generator=generator).to(weight.device, weight.dtype)
    with torch.inference_mode():
        want, got = norm(x), fused(x)
    if want.dtype != got.dtype or want.shape != got.shape:
        return False
    tol = probe_tolerance(want.dtype)
    return bool(torch.allclose(got.float(), want.float(), atol=tol, rtol=tol))


def fuse_norms(language_model: torch.nn.Module) -> tuple[int, int]:
    """Replace the known RMSNorm modules of ``language_model`` (decoder layers and the final
    norm); returns (replaced, kept) module counts."""
    verdict: dict[type, bool] = {}
    replaced = kept = 0
    targets = [
        (parent, name, child)
        for parent in language_model.modules()
        for name, child in parent.named_children()
        if type(child).__name__.endswith("RMSNorm")
    ]
    for parent, name, child in targets:
        cls = type(child)
        gemma = cls.__name__ in GEMMA_STYLE
        known = gemma or cls.__name__ in LLAMA_STYLE
        if not known or not isinstance(getattr(child, "weight", None), torch.Tensor):
            kept += 1
            continue
        fused = FusedRMSNorm(child, gemma=gemma)
        if cls not in verdict:
            verdict[cls] = _probe(child, fused)
            if not verdict[cls]:
                log.warning("fused norms: %s differs from rms_norm in a probe: kept", cls.__name__)
        if verdict[cls]:
            setattr(parent, name, fused)
            replaced += 1
        else:
            kept += 1
    return replaced, kept


def fused_norm_kernel(device: torch.device) -> bool:
    """Whether torch has a fused RMSNorm kernel for ``device`` (``aten::_fused_rms_norm``: CUDA
    on every supported torch; on CPU it is a composite of the ops transformers runs, slower
    from Python than transformers' own norm, so CPU models keep theirs)."""
    key = "CUDA" if device.type == "cuda" else device.type.upper()
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", key))
    except RuntimeError:  # an older torch without the op
        return False
