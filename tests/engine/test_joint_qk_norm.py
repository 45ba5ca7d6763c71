"""Gemma-style q_norm and k_norm over a fused q/k/v product in one pass
(``server/mmis/engine/execution/model/norms.py``, :class:`JointQKNorm`).

- On a fused product's q and k the pair gives the two norms' results (float32 bit for bit on
  CPU, bfloat16 within one rounding) and writes q and k side by side, so the joint rotary
  (``model/rotary.py``) takes them as one.
- Anything else falls back to the norm's own result: a q that is not part of such a product,
  a k that is not the memory after the q just normalised, a q whose storage ends before the
  heads after it (nothing outside q's storage is read), a k_norm call without a q_norm call.
- A fused Gemma 3 gets a pair in every layer and a norm pair of other arithmetic is not made.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

from mmis.engine.execution.model.norms import (
    FusedRMSNorm,
    JointQKNorm,
    JointQKNormPart,
    fuse_qk_norms,
)
from mmis.engine.execution.model.rotary import adjacent_heads

HQ, HK, D, TOKENS = 4, 2, 16, 7


def _norms() -> tuple[Gemma3RMSNorm, Gemma3RMSNorm]:
    torch.manual_seed(0)
    q_norm, k_norm = Gemma3RMSNorm(D, eps=1e-6), Gemma3RMSNorm(D, eps=1e-6)
    with torch.no_grad():
        q_norm.weight.normal_()
        k_norm.weight.normal_()
    return q_norm, k_norm


def _attention(q_norm: Any = None, k_norm: Any = None) -> torch.nn.Module:
    """An attention module's parts the pair reads: k_proj (its width) and the norms."""
    module = torch.nn.Module()
    module.k_proj = torch.nn.Linear(8, HK * D)
    module.q_norm, module.k_norm = q_norm, k_norm
    return module


ATTENTION = _attention()


def _pair() -> tuple[JointQKNorm, Gemma3RMSNorm, Gemma3RMSNorm]:
    q_norm, k_norm = _norms()
    fused = FusedRMSNorm(q_norm, gemma=True), FusedRMSNorm(k_norm, gemma=True)
    return JointQKNorm(*fused, ATTENTION), q_norm, k_norm


def _product(dtype: torch.dtype, tokens: int = TOKENS) -> tuple[torch.Tensor, ...]:
    """q, k, v as Gemma 3's attention makes them from one fused product."""
    qkv = torch.randn(1, tokens, (HQ + 2 * HK) * D).to(dtype)
    split = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
    return tuple(t.view(1, tokens, -1, D).transpose(1, 2) for t in split)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_q_and_k_get_the_two_norms_side_by_side(dtype: torch.dtype) -> None:
    pair, q_norm, k_norm = _pair()
    for tokens in (TOKENS, 1):  # a prefill and a decode row
        q, k, _ = _product(dtype, tokens)
        with torch.inference_mode():
            want_q, want_k = q_norm(q), k_norm(k)
            got_q, got_k = pair.normalise_q(q), pair.normalise_k(k)
        assert got_q.shape == want_q.shape and got_k.shape == want_k.shape
        assert got_q.dtype == got_k.dtype == dtype
        if dtype == torch.float32:  # the same arithmetic as Gemma3RMSNorm, in the same order
            assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
        else:  # float32 inside, rounded once to bfloat16 as transformers does
            torch.testing.assert_close(got_q, want_q, atol=0, rtol=2**-7)
            torch.testing.assert_close(got_k, want_k, atol=0, rtol=2**-7)
        joint = adjacent_heads(got_q, got_k)  # the rotary's test: k's heads follow q's
        assert joint is not None and joint.shape[1] == HQ + HK


def test_a_q_outside_a_product_or_a_foreign_k_gets_the_norms_own_result() -> None:
    pair, q_norm, k_norm = _pair()
    q, k, _ = _product(torch.float32)
    with torch.inference_mode():
        alone = q.contiguous()  # an unfused q: no heads after it in its row
        assert pair.joint_view(alone) is None
        assert torch.equal(pair.normalise_q(alone), q_norm(alone))
        # q of a product, then a k that is another tensor: k_norm's own result, not the kept
        pair.normalise_q(q)
        other = k.clone().mul_(3.0)
        assert torch.equal(pair.normalise_k(other), k_norm(other))
        # a k_norm call with no q_norm before it (the kept k is used once at most)
        pair.normalise_q(q)
        first = pair.normalise_k(k)
        again = pair.normalise_k(k)
        assert torch.equal(first, again) and again.data_ptr() != first.data_ptr()
        # a k of the same memory but another view (shape or strides) is not the kept one
        pair.normalise_q(q)
        sliced = k[:, :1]
        assert torch.equal(pair.normalise_k(sliced), k_norm(sliced))


def test_nothing_past_q_storage_is_read() -> None:
    pair, q_norm, _ = _pair()
    row = (HQ + 2 * HK) * D
    # q's rows as in a product, but the storage ends right after the last token's q heads
    base = torch.randn((TOKENS - 1) * row + HQ * D)
    q = base.as_strided((1, HQ, TOKENS, D), (TOKENS * row, D, row, 1))
    with torch.inference_mode():
        assert pair.joint_view(q) is None
        assert torch.equal(pair.normalise_q(q), q_norm(q))


def test_the_pair_replaces_only_gemma_style_norms_of_one_shape() -> None:
    attention = _attention
    q_norm, k_norm = _norms()
    gemma = attention(FusedRMSNorm(q_norm, gemma=True), FusedRMSNorm(k_norm, gemma=True))
    llama = attention(FusedRMSNorm(q_norm, gemma=False), FusedRMSNorm(k_norm, gemma=False))
    plain = attention(q_norm, k_norm)  # not replaced by rms_norm: nothing to join
    assert fuse_qk_norms([gemma, llama, plain]) == (1, 1)
    assert isinstance(gemma.q_norm, JointQKNormPart) and isinstance(gemma.k_norm, JointQKNormPart)
    assert type(llama.q_norm) is FusedRMSNorm and plain.q_norm is q_norm
    assert fuse_qk_norms([gemma]) == (1, 0)  # a second call changes nothing
    q, k, _ = _product(torch.float32)
    with torch.inference_mode():
        got = gemma.q_norm(q), gemma.k_norm(k)
        assert torch.equal(got[0], q_norm(q)) and torch.equal(got[1], k_norm(k))
