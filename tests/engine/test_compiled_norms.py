"""Gemma's norms as one compiled kernel each (``server/mmis/engine/execution/model/compiled.py``
through ``model/norms.py`` with ``compiled=True``: what a CUDA load runs), here on CPU, where
inductor builds C++ kernels from the same graphs it builds Triton kernels from on CUDA.

- A compiled Gemma-style norm equals ``Gemma3RMSNorm`` in bfloat16 and float16 (within one
  rounding of the dtype: the same float32 arithmetic, a row summed in another order) on a
  prefill, a decode batch and q_norm's transposed view, and keeps the input's memory order.
- The compiled joint q/k norm equals the two norms (float32 within a few ulps) and still
  writes q and k side by side, so the joint rotary takes them as one.
- A warm compiled call runs its kernel and nothing else that torch profiles as an op: no
  ``item()`` reading a float argument back (torch 2.11 did, unless floats are specialised).
- Shapes are dynamic: after the first step of two tokens or more, no step compiles again.
- A function that fails to compile runs eager from then on, logged, with the eager answer.
- A tiny Gemma 3 in bfloat16, fused as a CUDA load fuses it, with its norms compiled, gives
  the plain model's logits (within bfloat16's rounding) and runs the runner's steps.
- On CUDA (``-m cuda``): the Triton kernels equal ``Gemma3RMSNorm`` in bfloat16.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

from mmis.engine.execution.model import compiled, load_adapter
from mmis.engine.execution.model.fused import fuse_adapter
from mmis.engine.execution.model.norms import FusedRMSNorm, JointQKNorm
from mmis.engine.execution.model.rotary import adjacent_heads

HIDDEN, HQ, HK, D = 64, 4, 2, 16


def _gemma_norm(width: int, dtype: torch.dtype, device: str = "cpu") -> Gemma3RMSNorm:
    torch.manual_seed(0)
    norm = Gemma3RMSNorm(width, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    return norm.to(device, dtype)


def _unique_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_compiled_gemma_norm_is_transformers_norm(dtype: torch.dtype) -> None:
    norm = _gemma_norm(HIDDEN, dtype)
    fused = FusedRMSNorm(norm, gemma=True, compiled=True)
    prefill = torch.randn(1, 7, HIDDEN).to(dtype)
    decode = torch.randn(4, 1, HIDDEN).to(dtype)
    # q_norm's input: a [1, heads, n, head_dim] transpose of a slice of a fused product
    product = torch.randn(1, 5, 3 * HIDDEN).to(dtype)
    transposed = product[..., :HIDDEN].view(1, 5, 4, HIDDEN // 4).transpose(1, 2)
    narrow = _gemma_norm(HIDDEN // 4, dtype)
    cases = [(norm, fused, prefill), (norm, fused, decode)]
    cases.append((narrow, FusedRMSNorm(narrow, gemma=True, compiled=True), transposed))
    with torch.inference_mode():
        for original, replaced, x in cases:
            want, got = original(x), replaced(x)
            assert got.dtype == want.dtype == dtype and got.shape == want.shape
            torch.testing.assert_close(got, want, atol=0, rtol=torch.finfo(dtype).eps)
            assert got.transpose(1, 2).is_contiguous() == want.transpose(1, 2).is_contiguous()
    assert "gemma_rms_norm" not in compiled.BROKEN, compiled.BROKEN


def test_the_compiled_joint_norm_is_the_two_norms_side_by_side() -> None:
    attention = torch.nn.Module()
    attention.k_proj = torch.nn.Linear(8, HK * D)
    f32 = torch.finfo(torch.float32).eps
    for dtype, atol, rtol in ((torch.float32, 4 * f32, 4 * f32), (torch.bfloat16, 0, 2**-7)):
        q_norm, k_norm = _gemma_norm(D, dtype), _gemma_norm(D, dtype)
        with torch.no_grad():
            k_norm.weight.mul_(-2.0)  # another weight than q's
        fused = (FusedRMSNorm(n, gemma=True, compiled=True) for n in (q_norm, k_norm))
        pair = JointQKNorm(*fused, attention)
        for tokens in (7, 1):
            qkv = torch.randn(1, tokens, (HQ + 2 * HK) * D).to(dtype)
            q, k, _ = (
                t.view(1, tokens, -1, D).transpose(1, 2)
                for t in qkv.split([HQ * D, HK * D, HK * D], dim=-1)
            )
            with torch.inference_mode():
                want = q_norm(q), k_norm(k)
                got = pair.normalise_q(q), pair.normalise_k(k)
            for g, w in zip(got, want, strict=True):
                assert g.dtype == dtype and g.shape == w.shape
                torch.testing.assert_close(g, w, atol=atol, rtol=rtol)
            joint = adjacent_heads(*got)  # k's heads follow q's: the joint rotary's input
            assert joint is not None and joint.shape[1] == HQ + HK
    assert "joint_qk_norm" not in compiled.BROKEN, compiled.BROKEN


def test_other_batches_compile_nothing_more() -> None:
    norm = _gemma_norm(HIDDEN, torch.bfloat16)
    fused = FusedRMSNorm(norm, gemma=True, compiled=True)
    with torch.inference_mode():
        # a step's hidden states are [1, tokens, hidden] (``ModelAdapter.forward``): a size of
        # 1 is a constant of its graph, every other size one symbol
        fused(torch.randn(1, 2, HIDDEN).to(torch.bfloat16))
        before = _unique_graphs()
        for tokens in (3, 5, 16, 33, 200):
            x = torch.randn(1, tokens, HIDDEN).to(torch.bfloat16)
            torch.testing.assert_close(fused(x), norm(x), atol=0, rtol=2**-7)
    assert _unique_graphs() == before
    assert "gemma_rms_norm" not in compiled.BROKEN, compiled.BROKEN


def test_a_warm_compiled_call_reads_nothing_back() -> None:
    norm = FusedRMSNorm(_gemma_norm(HIDDEN, torch.bfloat16), gemma=True, compiled=True)
    x = torch.randn(1, 6, HIDDEN).to(torch.bfloat16)
    with torch.inference_mode():
        norm(x)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            norm(x)
    ops = {e.name for e in prof.events() if e.name.startswith("aten::")}
    assert not ops & {"aten::item", "aten::_local_scalar_dense"}, sorted(ops)
    assert "gemma_rms_norm" not in compiled.BROKEN, compiled.BROKEN


def test_a_function_that_will_not_compile_runs_eager_for_good(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def traced_in_two(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        torch._dynamo.graph_break()  # no single graph: ``fullgraph`` refuses it
        return y + 1

    monkeypatch.setattr(compiled, "BROKEN", {})
    x = torch.arange(4.0)
    with caplog.at_level(logging.WARNING):
        assert torch.equal(compiled.call(traced_in_two, x), x * 2 + 1)
    assert "traced_in_two" in compiled.BROKEN
    assert "compiled traced_in_two failed" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert torch.equal(compiled.call(traced_in_two, x), x * 2 + 1)
    assert caplog.text == ""  # logged once; eager from then on


@pytest.mark.model
def test_a_compiled_bf16_gemma3_gives_the_plain_models_logits(
    tiny_dirs: dict[str, Path], driver_cls: Any
) -> None:
    """(float32: tests/engine/test_fused_projections.py decodes every family fused as a CUDA
    load fuses it, Gemma 3's joint q/k norm compiled, as the plain model does.)"""
    from mmis.engine.execution.runner import ModelRunner

    plain = load_adapter(tiny_dirs["gemma3"], "cpu", torch.bfloat16, fuse=False)
    fused = load_adapter(tiny_dirs["gemma3"], "cpu", torch.bfloat16, fuse=False)
    report = fuse_adapter(fused, projections=True, norms=True, compiled=True)
    assert report.compiled and report.qk_norms == len(fused.language_model.layers)
    norms = [m for m in fused.language_model.modules() if isinstance(m, FusedRMSNorm)]
    assert norms and all(m.compiled for m in norms)
    ids = list(range(5, 45))
    with torch.inference_mode():
        want, got = plain.reference_logits(ids), fused.reference_logits(ids)
    # each side rounds to bfloat16 after every op: the same logits within that rounding
    torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.05)
    # prefill, mixed and decode steps of the runner through the compiled kernels
    driver = driver_cls(ModelRunner.create(fused, num_blocks=64, block_size=4))
    vocab = fused.vocab_size
    driver.add("a", [(3 * i + 5) % vocab for i in range(23)], [], max_tokens=8)
    driver.add("b", [(7 * i + 11) % vocab for i in range(9)], [], max_tokens=8, join_step=2)
    out = driver.run()
    assert [len(t) for t in out.values()] == [8, 8], out
    assert not compiled.BROKEN, compiled.BROKEN


@pytest.mark.cuda
def test_compiled_gemma_norms_on_cuda() -> None:
    norm = _gemma_norm(HIDDEN, torch.bfloat16, "cuda")
    fused = FusedRMSNorm(norm, gemma=True, compiled=True)
    with torch.inference_mode():
        for batch, tokens in ((1, 7), (4, 1), (32, 1)):
            x = torch.randn(batch, tokens, HIDDEN, device="cuda").to(torch.bfloat16)
            torch.testing.assert_close(fused(x), norm(x), atol=0, rtol=2**-7)
    assert not compiled.BROKEN, compiled.BROKEN
