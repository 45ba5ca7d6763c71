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
- :func:`fuse_qk_norms` (called by ``model/fused.py`` where q/k/v are one product) puts a
  :class:`JointQKNorm`'s two halves in the place of an attention's fused Gemma-style ``q_norm``
  and ``k_norm``. Called with q (a view of the fused product), the q half normalises q's heads
  and the ``Hk`` heads that follow them in memory (``Hk``: the attention's ``k_proj`` width)
  in one pass: ``rms_norm`` with no weight, times the stacked ``(1 + w)`` of both norms, in
  float32 (the two norms' arithmetic), written side by side, so ``model/rotary.py``'s joint
  rotary takes q and k as one too (Gemma 3 in float32: 27 kernels a decoder layer -> 21).
  The k half returns the kept k only when called with exactly the tensor whose memory was
  read (same data pointer, shape, and strides but those of a size-1 dimension, which address
  nothing; the read memory is held until then, so its address cannot be reused), else it
  normalises its input itself: a q that is not part of such a product, or a k that is not
  the memory after it, gets the two norms' own results. The q half reads only memory inside
  q's storage. As with ``FusedProjection``, an in-place write to k between the two calls
  would not be seen; the modeling code calls ``q_norm`` and ``k_norm`` back to back.
- Compiled (``fuse_norms(compiled=True)``, what a CUDA load asks for): a Gemma-style norm of a
  bfloat16/float16 input, and the joint q/k norm in every dtype, run as one compiled kernel
  each (``model/compiled.py``: Gemma 3 in bfloat16, 30 kernels a decoder layer -> 20; in
  float32, 21 -> 20), with the same float32 arithmetic up to the order of a row's sum.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable

import torch

from mmis.engine.execution.model import compiled as compiled_fns

log = logging.getLogger(__name__)

# RMSNorm classes of transformers by arithmetic (see the module docstring)
LLAMA_STYLE = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen2VLRMSNorm", "Qwen2_5_VLRMSNorm"})
GEMMA_STYLE = frozenset({"Gemma3RMSNorm"})


class FusedRMSNorm(torch.nn.Module):
    """A transformers RMSNorm computed by ``torch.nn.functional.rms_norm`` (one kernel on
    CUDA). ``gemma``: Gemma's ``(1 + weight)`` scale, applied in float32 like Gemma 3 does.
    ``compiled``: a Gemma norm of a bfloat16/float16 input runs as one compiled kernel
    (``model/compiled.py``) instead of an up-cast, ``rms_norm`` and a down-cast."""

    def __init__(self, norm: torch.nn.Module, *, gemma: bool, compiled: bool = False) -> None:
        super().__init__()
        weight = _weight(norm).detach()
        self.gemma = gemma
        self.compiled = compiled
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
        if self.gemma and self.compiled and x.dtype != torch.float32:
            out = compiled_fns.call(compiled_fns.gemma_rms_norm, x, self.weight, self.eps)
        elif self.gemma:  # the same arithmetic, eager (float32: rms_norm alone, one kernel)
            out = compiled_fns.gemma_rms_norm(x, self.weight, self.eps)
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


class JointQKNorm:
    """The shared state of a fused ``q_norm``/``k_norm`` pair (see the module docstring)."""

    def __init__(
        self, q_norm: FusedRMSNorm, k_norm: FusedRMSNorm, attention: torch.nn.Module
    ) -> None:
        self.q_norm, self.k_norm = q_norm, k_norm
        self.compiled = q_norm.compiled  # one compiled kernel (model/compiled.py) for the pair
        self._attention = weakref.ref(attention)  # the module holds the pair: no cycle
        self.eps = q_norm.eps
        self._weights: dict[tuple[int, int, torch.device], torch.Tensor] = {}
        # (the joint input view read, k's data pointer, shape, strides, normalised k) or None
        self._kept: tuple[torch.Tensor, int, torch.Size, tuple[int, ...], torch.Tensor] | None
        self._kept = None

    def weight(self, hq: int, hk: int, device: torch.device) -> torch.Tensor:
        """``[hq + hk, D]`` float32: q_norm's ``(1 + w)`` for q's heads, k_norm's for k's."""
        key = (hq, hk, device)
        stacked = self._weights.get(key)
        if stacked is None:
            wq, wk = self.q_norm.weight.float(), self.k_norm.weight.float()
            dim = wq.shape[-1]
            stacked = torch.cat((wq.expand(hq, dim), wk.expand(hk, dim))).to(device)
            self._weights[key] = stacked
        return stacked

    def joint_view(self, q: torch.Tensor) -> torch.Tensor | None:
        """``[B, Hq + Hk, S, D]`` over q's heads and the ``Hk`` heads after them in q's
        storage (``Hk``: the attention's ``k_proj`` width in heads, read per call, so a tensor
        parallel rank's count), where q's heads lie side by side in a token's row and the row
        holds them all; else None. Only memory inside q's storage is covered."""
        if q.dim() != 4 or q.stride(-1) != 1:
            return None
        _, hq, tokens, dim = q.shape
        if q.stride(1) != dim or dim != self.q_norm.shape[0]:
            return None
        attention = self._attention()
        k_proj = None if attention is None else attention._modules.get("k_proj")
        width = getattr(k_proj, "out_features", 0)
        hk = width // dim if isinstance(width, int) and width % dim == 0 else 0
        if hk < 1 or (tokens > 1 and q.stride(2) < (hq + hk) * dim):
            return None
        size = (q.shape[0], hq + hk, tokens, dim)
        reach = sum((n - 1) * st for n, st in zip(size, q.stride(), strict=True))
        if q.storage_offset() + reach >= q.untyped_storage().nbytes() // q.element_size():
            return None
        return q.as_strided(size, q.stride(), q.storage_offset())

    def normalise_q(self, q: torch.Tensor) -> torch.Tensor:
        self._kept = None
        joint = self.joint_view(q)
        if joint is None:
            return self.q_norm(q)
        hq = q.shape[1]
        order = [0, 2, 1, 3]  # [B, S, H, D]: rows as they lie in memory
        rows = joint.permute(order)
        weight = self.weight(hq, joint.shape[1] - hq, q.device)
        if self.compiled:
            norm = compiled_fns.joint_qk_norm
            out = compiled_fns.call(norm, rows, weight, self.eps, q.dtype)
        else:
            normed = torch.nn.functional.rms_norm(rows.float(), self.q_norm.shape, None, self.eps)
            # the product in float32, rounded once to q's dtype: Gemma's ``(x * w).to(dtype)``
            out = torch.mul(normed, weight, out=torch.empty_like(normed, dtype=q.dtype))
        out = out.permute(order)
        k = joint[:, hq:]
        self._kept = (joint, k.data_ptr(), k.shape, k.stride(), out[:, hq:])
        return out[:, :hq]

    def normalise_k(self, k: torch.Tensor) -> torch.Tensor:
        kept, self._kept = self._kept, None
        if (
            kept is not None
            and kept[1] == k.data_ptr()
            and kept[2] == k.shape
            and all(n == 1 or a == b for n, a, b in zip(k.shape, kept[3], k.stride(), strict=True))
            and kept[4].dtype == k.dtype
        ):
            return kept[4]
        return self.k_norm(k)


class JointQKNormPart(torch.nn.Module):
    """``q_norm`` (``which="q"``) or ``k_norm`` (``"k"``) of a :class:`JointQKNorm`."""

    def __init__(self, pair: JointQKNorm, which: str) -> None:
        super().__init__()
        self.which = which
        self.norm = pair.q_norm if which == "q" else pair.k_norm  # its weight, as a module
        self.__dict__["_call"] = pair.normalise_q if which == "q" else pair.normalise_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        call: Callable[[torch.Tensor], torch.Tensor] = self.__dict__["_call"]
        return call(x)

    def extra_repr(self) -> str:
        return f"{self.which} half of a joint q/k norm"


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


def fuse_norms(language_model: torch.nn.Module, *, compiled: bool = False) -> tuple[int, int]:
    """Replace the known RMSNorm modules of ``language_model`` (decoder layers and the final
    norm); returns (replaced, kept) module counts. ``compiled``: Gemma-style norms (and the
    joint q/k norms :func:`fuse_qk_norms` makes of them) run compiled (:class:`FusedRMSNorm`)."""
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
        fused = FusedRMSNorm(child, gemma=gemma, compiled=compiled)
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


def _probe_pair(q_norm: FusedRMSNorm, k_norm: FusedRMSNorm, hq: int, hk: int) -> bool:
    """Whether a pair of these norms takes its joint path on a fused product's q and k
    (``hq`` and ``hk`` heads, float32 and bfloat16) and gives the two norms' results there
    (values within :func:`probe_tolerance`)."""
    dim = q_norm.shape[0]
    attention = torch.nn.Module()
    attention.k_proj = torch.nn.Linear(1, hk * dim, device="meta")
    pair = JointQKNorm(q_norm, k_norm, attention)
    generator = torch.Generator(device="cpu").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        product = torch.randn(1, 5, (hq + 2 * hk) * dim, generator=generator)
        product = product.to(pair.q_norm.weight.device, dtype)
        q = product[..., : hq * dim].view(1, 5, hq, dim).transpose(1, 2)
        k = product[..., hq * dim : (hq + hk) * dim].view(1, 5, hk, dim).transpose(1, 2)
        with torch.inference_mode():
            want = pair.q_norm(q), pair.k_norm(k)
            got = pair.normalise_q(q), pair.normalise_k(k)
        if got[1].data_ptr() != got[0].data_ptr() + hq * dim * got[0].element_size():
            return False  # not side by side: the joint path was not taken
        tol = probe_tolerance(dtype)
        for g, w in zip(got, want, strict=True):
            if g.dtype != w.dtype or not torch.allclose(g.float(), w.float(), atol=tol, rtol=tol):
                return False
    return True


def fuse_qk_norms(attention_modules: Iterable[torch.nn.Module]) -> tuple[int, int]:
    """Put a :class:`JointQKNorm`'s halves in the place of each attention module's
    ``q_norm``/``k_norm`` that are Gemma-style :class:`FusedRMSNorm` of one shape and eps;
    returns (pairs made or already there, pairs kept as they were)."""
    made = kept = 0
    verdict: bool | None = None
    for attention in attention_modules:
        q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
        if isinstance(q_norm, JointQKNormPart):
            made += 1
            continue
        if not (isinstance(q_norm, FusedRMSNorm) and isinstance(k_norm, FusedRMSNorm)):
            continue
        if not (q_norm.gemma and k_norm.gemma) or (q_norm.shape, q_norm.eps) != (
            k_norm.shape,
            k_norm.eps,
        ):
            kept += 1
            continue
        if verdict is None:
            verdict = _probe_pair(q_norm, k_norm, 4, 2)
            if not verdict:
                log.warning("joint q/k norm: differs from the two norms in a probe: kept")
        if not verdict:
            kept += 1
            continue
        pair = JointQKNorm(q_norm, k_norm, attention)
        attention.q_norm = JointQKNormPart(pair, "q")
        attention.k_norm = JointQKNormPart(pair, "k")
        made += 1
    return made, kept


def fused_norm_kernel(device: torch.device) -> bool:
    """Whether torch has a fused RMSNorm kernel for ``device`` (``aten::_fused_rms_norm``: CUDA
    on every supported torch; on CPU it is a composite of the ops transformers runs, slower
    from Python than transformers' own norm, so CPU models keep theirs)."""
    key = "CUDA" if device.type == "cuda" else device.type.upper()
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", key))
    except RuntimeError:  # an older torch without the op
        return False
