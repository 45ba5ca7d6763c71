"""Fused q/k/v, gate/up and RMSNorm (``server/mmis/engine/execution/model/fused.py``,
``model/norms.py``).

- A fused sibling never returns a slice of another input's product (nor of an input written in
  place since), computes exactly what its linear did, and keeps nothing once every part is out.
- Every family's tiny model decodes the same greedy tokens through the runner, and gives the
  same logits, fused and unfused; the fused model holds no second copy of the weights.
- Tensor parallelism splits a fused model as it splits a plain one (each rank fuses its rows).
- A norm class whose arithmetic differs from ``rms_norm`` is kept (the load-time probe).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mmis.engine.execution.model import load_adapter
from mmis.engine.execution.model.fused import (
    FusedPart,
    FusedProjection,
    fuse_adapter,
    fuse_group,
    fuse_projections,
)
from mmis.engine.execution.model.norms import (
    FusedRMSNorm,
    fuse_norms,
    fused_norm_kernel,
    probe_tolerance,
)
from mmis.engine.execution.tensor_parallel import shard_adapter
from mmis.tiny_models.tiny_model import FAMILIES as ALL_FAMILIES

QKV = ("q_proj", "k_proj", "v_proj")


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to float32 rounding (a GEMM of another width may sum in another order); two
    different random inputs are never this close."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class _Attention(torch.nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q_proj = torch.nn.Linear(8, 12, bias=bias)
        self.k_proj = torch.nn.Linear(8, 4, bias=bias)
        self.v_proj = torch.nn.Linear(8, 4, bias=bias)


def _fused(bias: bool = True) -> tuple[_Attention, dict[str, torch.nn.Linear]]:
    module = _Attention(bias)
    plain = {name: getattr(module, name) for name in QKV}
    assert fuse_group(module, QKV)
    return module, plain


@pytest.mark.parametrize("inference", [False, True])
def test_a_sibling_never_returns_a_slice_of_another_inputs_product(inference: bool) -> None:
    module, plain = _fused()
    group = module.q_proj.group
    x1, x2 = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    with torch.inference_mode(inference), torch.no_grad():
        if inference:
            x1, x2 = x1.clone(), x2.clone()  # inference tensors: no version counter
        close(module.q_proj(x1), plain["q_proj"](x1))
        close(module.k_proj(x2), plain["k_proj"](x2))  # not x1's k
        same_storage = x2[:]  # another tensor object over x2's memory
        close(module.v_proj(same_storage), plain["v_proj"](x2))
        # a part asked for twice for one input is computed again, still right
        close(module.q_proj(x1), plain["q_proj"](x1))
        close(module.q_proj(x1), plain["q_proj"](x1))
        # every part out: nothing of the input or its product is kept
        for name in QKV:
            getattr(module, name)(x2)
        assert group._state is None


def test_an_input_written_in_place_between_siblings_is_computed_again() -> None:
    module, plain = _fused()
    x = torch.randn(1, 3, 8)
    with torch.no_grad():
        module.q_proj(x)
        x.mul_(2.0)  # bumps the version counter: the cached product is stale
        close(module.k_proj(x), plain["k_proj"](x))


@pytest.mark.parametrize("bias", [False, True])
def test_each_part_is_what_its_linear_computed(bias: bool) -> None:
    module, plain = _fused(bias)
    x = torch.randn(2, 7, 8)
    with torch.no_grad():
        for name in QKV:
            got, want = getattr(module, name)(x), plain[name](x)
            assert got.shape == want.shape and got.dtype == want.dtype
            close(got, want)
            assert got.view(2, 7, -1, 4).shape[-2] == want.shape[-1] // 4  # HF's head split
    fused = module.q_proj.group.linear
    assert fused.weight.shape == (20, 8) and (fused.bias is not None) == bias


def test_mixed_biases_or_widths_stay_unfused() -> None:
    module = _Attention(bias=True)
    module.k_proj = torch.nn.Linear(8, 4, bias=False)
    assert not fuse_group(module, QKV)
    assert all(type(getattr(module, n)) is torch.nn.Linear for n in QKV)


def _text_run(adapter: Any, driver_cls: Any) -> dict[str, list[int]]:
    from mmis.engine.execution.runner import ModelRunner

    runner = ModelRunner.create(adapter, num_blocks=64, block_size=4)
    driver = driver_cls(runner)
    vocab = adapter.vocab_size
    driver.add("a", [(3 * i + 5) % vocab for i in range(23)], [], max_tokens=8)
    driver.add("b", [(7 * i + 11) % vocab for i in range(9)], [], max_tokens=8, join_step=2)
    return driver.run()


@pytest.mark.model
@pytest.mark.parametrize("name", ALL_FAMILIES)
def test_every_family_decodes_the_same_fused_and_unfused(
    name: str, tiny_dirs: dict[str, Path], driver_cls: Any
) -> None:
    plain = load_adapter(tiny_dirs[name], "cpu", torch.float32, fuse=False)
    cpu_load = load_adapter(tiny_dirs[name], "cpu", torch.float32)  # a CPU load fuses nothing
    assert not any(isinstance(m, (FusedPart, FusedRMSNorm)) for m in cpu_load.model.modules())
    fused = load_adapter(tiny_dirs[name], "cpu", torch.float32, fuse=False)
    fuse_adapter(fused, projections=True, norms=False)  # projections only
    cuda_like = load_adapter(tiny_dirs[name], "cpu", torch.float32, fuse=False)
    fuse_adapter(cuda_like, projections=True, norms=True, compiled=True)  # a CUDA load's
    assert not fused_norm_kernel(torch.device("cpu"))
    assert not any(isinstance(m, FusedRMSNorm) for m in fused.model.modules())
    for layer in cuda_like.language_model.layers:
        assert isinstance(layer.input_layernorm, FusedRMSNorm)
    assert isinstance(cuda_like.language_model.norm, FusedRMSNorm)
    count = lambda a: sum(p.numel() for p in a.language_model.parameters())  # noqa: E731
    ids = list(range(5, 45))
    with torch.inference_mode():  # the self-check's reference forward (transformers' sdpa)
        want = plain.reference_logits(ids)
    expected = _text_run(plain, driver_cls)
    for adapter in (fused, cuda_like):
        layers = adapter.language_model.layers
        for layer in layers:  # really fused, every layer
            assert all(isinstance(getattr(layer.self_attn, n), FusedPart) for n in QKV)
            assert isinstance(layer.mlp.gate_proj, FusedPart)
        assert count(adapter) == count(plain)  # the weights are not held twice
        # per layer: the fused q/k/v, o_proj, the fused gate/up, down_proj (no unfused one left)
        assert sum(type(m) is torch.nn.Linear for m in layers.modules()) == 4 * len(layers)
        with torch.inference_mode():
            torch.testing.assert_close(adapter.reference_logits(ids), want)
        assert _text_run(adapter, driver_cls) == expected


@pytest.mark.model
@pytest.mark.parametrize("name", ["llava", "qwen2-vl", "gemma3"])
def test_tensor_parallel_splits_a_fused_model_like_a_plain_one(
    name: str, tiny_dirs: dict[str, Path]
) -> None:
    for rank in range(2):
        plain = load_adapter(tiny_dirs[name], "cpu", torch.float32, fuse=False)
        fused = load_adapter(tiny_dirs[name], "cpu", torch.float32, fuse=False)
        fuse_adapter(fused, projections=True, norms=False)
        shard_adapter(plain, rank, 2)
        shard_adapter(fused, rank, 2)
        assert (fused.num_heads, fused.num_kv_heads) == (plain.num_heads, plain.num_kv_heads)
        x = torch.randn(1, 6, fused.hidden_size)
        with torch.inference_mode():
            for p_layer, f_layer in zip(
                plain.language_model.layers, fused.language_model.layers, strict=True
            ):
                for parent, names in (("self_attn", QKV), ("mlp", ("gate_proj", "up_proj"))):
                    for n in names:
                        part = getattr(getattr(f_layer, parent), n)
                        assert isinstance(part, FusedPart)  # this rank's rows, fused again
                        want = getattr(getattr(p_layer, parent), n)(x)
                        close(part(x), want)
                rows = f_layer.self_attn.q_proj.group.linear.weight.shape[0]
                assert rows == (fused.num_heads + 2 * fused.num_kv_heads) * fused.head_dim


def test_a_norm_whose_arithmetic_differs_is_kept() -> None:
    class LlamaRMSNorm(torch.nn.Module):  # a known name, other arithmetic
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))
            self.variance_epsilon = 1e-6

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    class Gemma3RMSNorm(torch.nn.Module):  # the real arithmetic: replaced
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8))
            self.eps = 1e-6

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
            return (out * (1.0 + self.weight.float())).type_as(x)

    model = torch.nn.Module()
    model.odd = LlamaRMSNorm()
    model.gemma = Gemma3RMSNorm()
    assert fuse_norms(model) == (1, 1)
    assert type(model.odd) is LlamaRMSNorm and isinstance(model.gemma, FusedRMSNorm)


def test_fusing_twice_changes_nothing() -> None:
    layers = torch.nn.ModuleList([torch.nn.Module()])
    layers[0].self_attn = _Attention(bias=False)
    assert fuse_projections(layers) == (1, 0)
    group = layers[0].self_attn.q_proj.group
    assert fuse_projections(layers) == (1, 0)
    assert layers[0].self_attn.q_proj.group is group
    assert isinstance(group, FusedProjection)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_norm_of_a_transposed_slice_is_transformers_norm_in_its_layout(
    dtype: torch.dtype,
) -> None:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gemma, llama = Gemma3RMSNorm(16), LlamaRMSNorm(16)
    with torch.no_grad():
        gemma.weight.normal_()
        llama.weight.normal_()
    model = torch.nn.Module()
    model.gemma, model.llama = gemma.to(dtype), llama.to(dtype)
    assert fuse_norms(model) == (2, 0)
    # Gemma 3's q_norm input: a [1, heads, n, head_dim] transpose of a slice of the fused q/k/v
    fused_qkv = torch.randn(1, 5, (4 + 2 + 2) * 16).to(dtype)
    q = fused_qkv[..., : 4 * 16].view(1, 5, 4, 16).transpose(1, 2)
    with torch.no_grad():
        for original, replaced in ((gemma, model.gemma), (llama, model.llama)):
            want, got = original(q), replaced(q)
            assert got.dtype == want.dtype
            if dtype == torch.float32 or original is gemma:  # the same arithmetic
                assert torch.equal(got, want)
            else:  # Llama's rounds twice (normed, then times the weight), rms_norm once
                tol = probe_tolerance(dtype)
                torch.testing.assert_close(got, want, rtol=tol, atol=tol)
            # rows in the input's memory order: transposing back to [1, n, heads * head_dim]
            # (the attention output's reshape) needs no copy, as with transformers' norm
            assert got.transpose(1, 2).is_contiguous() == want.transpose(1, 2).is_contiguous()
