"""q and k's rotary embeddings as one (``server/mmis/engine/execution/model/rotary.py``).

- On adjacent q/k heads (a fused q/k/v product's layout) the joint rotary is transformers'
  ``apply_rotary_pos_emb`` bit for bit, in float32 and bfloat16, without calling it.
- Any other pair or call (separate tensors, a gap between q and k, another ``unsqueeze_dim``,
  an older signature's position ids) runs the original function, so a plain model in the
  same process computes what it did.
- The signed ``sin`` is made once per ``sin`` and made again for another or a changed one.
- A fused tiny model takes the joint path in every layer and a plain one never does, with the
  same logits, Gemma 3 too (its q_norm/k_norm between the projection and the rotary write q and
  k side by side: ``model/norms.py``'s joint q/k norm, ``tests/engine/test_joint_qk_norm.py``).
- A modeling module whose function computes otherwise keeps it (the load-time probe).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers.models.llama import modeling_llama

from mmis.engine.execution.model import load_adapter
from mmis.engine.execution.model.fused import fuse_adapter
from mmis.engine.execution.model.rotary import JointRotary, adjacent_heads, fuse_rotary

ORIGINAL = (
    modeling_llama.apply_rotary_pos_emb.original
    if isinstance(modeling_llama.apply_rotary_pos_emb, JointRotary)
    else modeling_llama.apply_rotary_pos_emb
)


class _Counted:
    """A rotary function that counts its calls and runs ``inner``."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner(*args, **kwargs)


def _qkv(dtype: torch.dtype, tokens: int = 7, hq: int = 4, hk: int = 2, d: int = 16) -> Any:
    """q, k, v as a fused product's views (``[1, heads, tokens, d]``) and HF-style cos/sin."""
    qkv = torch.randn(1, tokens, (hq + 2 * hk) * d).to(dtype)
    split = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = (t.view(1, tokens, -1, d).transpose(1, 2) for t in split)
    freqs = torch.rand(1, tokens, d // 2) * 40.0  # positions x inverse frequencies
    angles = torch.cat((freqs, freqs), dim=-1)
    return q, k, v, angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adjacent_heads_get_transformers_rotary_bit_for_bit(dtype: torch.dtype) -> None:
    q, k, _, cos, sin = _qkv(dtype)
    counted = _Counted(ORIGINAL)
    joint = JointRotary(counted)
    with torch.inference_mode():
        got = joint(q, k, cos, sin)
        want = ORIGINAL(q, k, cos, sin)
    assert counted.calls == 0  # the joint path, not the original
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g, w)


def test_other_pairs_run_the_original() -> None:
    q, k, v, cos, sin = _qkv(torch.float32)
    counted = _Counted(ORIGINAL)
    joint = JointRotary(counted)
    pairs = [
        (q.clone(), k.clone()),  # separate tensors
        (q, v),  # a gap: k's heads lie between
        (k, q),  # the wrong order
    ]
    for a, b in pairs:
        assert adjacent_heads(a, b) is None
        got = joint(a, b, cos, sin)
        for g, w in zip(got, ORIGINAL(a, b, cos, sin), strict=True):
            assert torch.equal(g, w)
    assert counted.calls == len(pairs)
    # another unsqueeze_dim ([1, tokens, heads, d] layout): the original, given it
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)
    got = joint(qt, kt, cos, sin, unsqueeze_dim=2)
    assert counted.calls == len(pairs) + 1
    for g, w in zip(got, ORIGINAL(qt, kt, cos, sin, unsqueeze_dim=2), strict=True):
        assert torch.equal(g, w)
    # an older signature's fifth argument (position ids, a tensor): the original, given it
    legacy = _Counted(lambda q, k, cos, sin, position_ids, **_: ORIGINAL(q, k, cos, sin))
    got = JointRotary(legacy)(q, k, cos, sin, torch.arange(q.shape[2]))
    assert legacy.calls == 1
    for g, w in zip(got, ORIGINAL(q, k, cos, sin), strict=True):
        assert torch.equal(g, w)


def test_the_signed_sin_is_made_once_per_unchanged_sin() -> None:
    joint = JointRotary(ORIGINAL)
    _, _, _, _, sin = _qkv(torch.float32)
    first = joint.signed(sin)
    half = sin.shape[-1] // 2
    assert torch.equal(first, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1))
    assert joint.signed(sin) is first  # the next layer of the step
    sin.mul_(0.5)  # written in place: its version moved
    again = joint.signed(sin)
    assert again is not first and torch.equal(again[..., half:], sin[..., half:])
    other = sin.clone()  # another tensor, same values
    assert joint.signed(other) is not again


@pytest.mark.model
@pytest.mark.parametrize("name", ["llava", "gemma3"])
def test_a_fused_model_takes_the_joint_path_and_a_plain_one_never(
    name: str, tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = load_adapter(tiny_dirs[name], "cpu", torch.float32, fuse=False)
    fused = load_adapter(tiny_dirs[name], "cpu", torch.float32, fuse=False)
    report = fuse_adapter(fused, projections=True, norms=True)
    assert (report.rotary, report.rotary_kept) == (1, 0)
    attention = fused.language_model.layers[0].self_attn
    module = __import__(type(attention).__module__, fromlist=["_"])
    rotary = module.apply_rotary_pos_emb
    assert isinstance(rotary, JointRotary)
    counted = _Counted(rotary.original)
    monkeypatch.setattr(rotary, "original", counted)
    ids = list(range(5, 45))
    layers = len(fused.language_model.layers)
    with torch.inference_mode():
        want = plain.reference_logits(ids)
        assert counted.calls == layers  # a plain model: the original, every layer
        got = fused.reference_logits(ids)
    # q and k adjacent (gemma3: the joint q/k norm's output), no call of the original
    assert counted.calls == layers
    assert torch.equal(got, want)


def test_a_rotary_with_other_arithmetic_is_kept() -> None:
    def interleaved(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: int = 1) -> Any:
        """GPT-J style pairs (x0, x1), (x2, x3)...: not rotate_half."""

        def rot(x: torch.Tensor) -> torch.Tensor:
            pairs = x.unflatten(-1, (-1, 2))
            return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)

        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin

    odd = types.ModuleType("mmis_test_odd_modeling")
    odd.apply_rotary_pos_emb = interleaved  # type: ignore[attr-defined]
    attention_cls = type("OddAttention", (torch.nn.Module,), {"__module__": odd.__name__})
    sys.modules[odd.__name__] = odd
    try:
        assert fuse_rotary([attention_cls(), attention_cls()]) == (0, 1)
        assert odd.apply_rotary_pos_emb is interleaved
        # the real one passes the same probe, and installing twice changes nothing
        real = types.ModuleType("mmis_test_real_modeling")
        real.apply_rotary_pos_emb = ORIGINAL  # type: ignore[attr-defined]
        sys.modules[real.__name__] = real
        real_cls = type("RealAttention", (torch.nn.Module,), {"__module__": real.__name__})
        assert fuse_rotary([real_cls()]) == (1, 0)
        installed = real.apply_rotary_pos_emb
        assert isinstance(installed, JointRotary)
        assert fuse_rotary([real_cls()]) == (1, 0)
        assert real.apply_rotary_pos_emb is installed
    finally:
        sys.modules.pop(odd.__name__, None)
        sys.modules.pop("mmis_test_real_modeling", None)
