"""Rotary embeddings of a fused q and k in one pass, made at load (issue 44, build item 4).

Every family's attention here calls its modeling module's ``apply_rotary_pos_emb(q, k, cos,
sin)``, which runs ``x * cos + rotate_half(x) * sin`` for q and for k: ten kernels a layer
(``mul``, ``neg``, ``cat``, ``mul``, ``add``, twice), half of what is left of a fused Llama
decoder layer outside attention (``benchmarks/README.md``, "Kernels per decoder layer").
Once q/k/v are one product (``model/fused.py``), q's heads and k's heads lie side by side in
memory: the same view with ``Hq + Hk`` heads covers both. :class:`JointRotary` takes the place
of the module's function and, for such a pair, computes both in four kernels over that joint
view: ``joint * cos + roll(joint, D/2) * signed``, where ``signed`` is ``sin`` with its first
half negated (``rotate_half(x) == roll(x, D/2) * [-1, +1]``), made once per step: every layer of
a forward gets the same ``sin`` tensor, and the last one made is kept for the next layer.

Invariants:
- The result is bit for bit transformers' own: the same products summed in the same order
  (``-a * s == a * -s`` exactly in IEEE arithmetic), in the same dtype. A load-time probe
  (:func:`_probe`) checks this with ``torch.equal`` on the module's real function before
  replacing it; a function that differs (another transformers' arithmetic) is kept.
- Any other call (q and k not adjacent heads of one tensor: an unfused model, Gemma 3's
  q_norm/k_norm outputs, a reference model of tests or of the self-check in the same
  process, another ``unsqueeze_dim``) runs the original function with the same arguments:
  replacing a module's function changes no result anywhere.
- The joint view is taken only when k's storage offset is exactly q's plus ``Hq`` head
  strides in the same storage, with equal strides and shapes but the head count: its heads
  ``Hq..Hq+Hk-1`` are then k's heads element for element, and nothing else is read.
- The kept ``signed`` is reused only for the same ``sin`` object (held, so its id cannot be
  recycled) with the same data pointer, shape and, where it has one, version counter.
- Installing is idempotent, per modeling module (:func:`fuse_rotary`).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

log = logging.getLogger(__name__)

FUNCTION = "apply_rotary_pos_emb"

Rotary = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """The ``[B, Hq + Hk, S, D]`` view covering q's heads then k's, where k's heads follow q's
    in memory exactly (see the module docstring); else None."""
    if q.dim() != 4 or k.dim() != 4 or q.dtype != k.dtype or q.device != k.device:
        return None
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or q.stride() != k.stride():
        return None
    if q.stride(-1) != 1 or q.shape[-1] % 2:
        return None
    if q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr():
        return None
    if k.storage_offset() != q.storage_offset() + q.shape[1] * q.stride(1):
        return None
    size = (q.shape[0], q.shape[1] + k.shape[1], q.shape[2], q.shape[3])
    return q.as_strided(size, q.stride(), q.storage_offset())


class JointRotary:
    """Stands in for a modeling module's ``apply_rotary_pos_emb`` (see the module docstring)."""

    def __init__(self, original: Rotary) -> None:
        self.original = original
        functools.update_wrapper(self, original)
        # (sin, its data pointer, shape, version, sin with its first half negated) or None
        self._signed: tuple[torch.Tensor, int, torch.Size, int | None, torch.Tensor] | None
        self._signed = None

    def signed(self, sin: torch.Tensor) -> torch.Tensor:
        """``sin`` with its first half negated: the kept one for the same, unchanged ``sin``."""
        version = None if sin.is_inference() else sin._version
        state = self._signed
        if (
            state is not None
            and state[0] is sin
            and state[1] == sin.data_ptr()
            and state[2] == sin.shape
            and state[3] == version
        ):
            return state[4]
        half = sin.shape[-1] // 2
        signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        self._signed = (sin, sin.data_ptr(), sin.shape, version, signed)
        return signed

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        unsqueeze_dim: int = 1,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        plain = args or kwargs or not (isinstance(unsqueeze_dim, int) and unsqueeze_dim == 1)
        joint = None if plain else adjacent_heads(q, k)
        if joint is None or cos.shape[-1] != q.shape[-1] or sin.shape != cos.shape:
            return self.original(q, k, cos, sin, unsqueeze_dim, *args, **kwargs)
        half = q.shape[-1] // 2
        out = joint * cos.unsqueeze(1) + joint.roll(half, dims=-1) * self.signed(sin).unsqueeze(1)
        heads = q.shape[1]
        return out[:, :heads], out[:, heads:]


def _probe(original: Rotary) -> bool:
    """Whether :class:`JointRotary` gives ``original``'s result bit for bit on adjacent q/k
    (a fused product's layout, float32 and bfloat16, 3 q heads and 2 k heads of 8)."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    joint = JointRotary(original)
    for dtype in (torch.float32, torch.bfloat16):
        qkv = torch.randn(1, 5, (3 + 2 + 2) * 8, generator=generator).to(dtype)
        q = qkv[..., :24].view(1, 5, 3, 8).transpose(1, 2)
        k = qkv[..., 24:40].view(1, 5, 2, 8).transpose(1, 2)
        angles = torch.rand(1, 5, 4, generator=generator) * 6.0
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        if adjacent_heads(q, k) is None:  # the joint path would not even be taken
            return False
        with torch.inference_mode():
            want, got = original(q, k, cos, sin), joint(q, k, cos, sin)
        pairs = zip(got, want, strict=True)
        if not all(torch.equal(g, w) and g.dtype == w.dtype for g, w in pairs):
            return False
    return True


def fuse_rotary(attention_modules: Iterable[torch.nn.Module]) -> tuple[int, int]:
    """Put a :class:`JointRotary` in place of ``apply_rotary_pos_emb`` in the modeling module of
    each attention class given; returns (modules using it, modules kept as they were)."""
    used = kept = 0
    seen: set[str] = set()
    for attention in attention_modules:
        name = type(attention).__module__
        if name in seen:
            continue
        seen.add(name)
        module = sys.modules.get(name)
        original = getattr(module, FUNCTION, None)
        if isinstance(original, JointRotary):
            used += 1
        elif module is not None and callable(original) and _probe(original):
            setattr(module, FUNCTION, JointRotary(original))
            used += 1
        else:
            kept += 1
            if original is not None:
                log.warning("joint rotary: %s.%s differs in a probe: kept", name, FUNCTION)
    return used, kept
