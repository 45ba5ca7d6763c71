"""Attention backend selection (``engine/execution/attn_backends.py``): a varlen kernel is chosen
only
if it passes the start-up probe (signature, head size, dtype, GQA, window, page size, numbers
against torch SDPA), the next one otherwise, the reason logged; and the start-up self-check
moves a runner whose flash backend fails it to torch SDPA. All on CPU, with fake kernels in
plain torch that mimic each known ``varlen_attn`` signature."""

from __future__ import annotations

import inspect
import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from mmis.engine.execution import varlen_backend
from mmis.engine.execution.attn_backends import ProbeShape, TorchBackend, select_backend
from mmis.engine.execution.model import load_adapter
from mmis.engine.execution.paged_attention import AttentionMetadata, KVCacheSpec, PagedKVPool
from mmis.engine.execution.runner import ModelRunner
from mmis.engine.execution.varlen_backend import VarlenBackend, VarlenKernel, torch_varlen_kernel
from mmis.engine.self_check import TOLERANCE, run_self_check

CPU = torch.device("cpu")
GQA = ProbeShape(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
LOGGER = "mmis.engine.execution.attn_backends"


def _varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor | None,
    *,
    scale: float | None,
    window_size: tuple[int, int],
    enable_gqa: bool,
    seqused_k: torch.Tensor | None,
    block_table: torch.Tensor | None,
) -> torch.Tensor:
    """Flash varlen semantics in plain torch, one SDPA per sequence: causal aligned
    bottom-right, ``window_size[0]`` keys to the left, K/V packed by ``cu_k`` or paged by
    ``block_table`` + ``seqused_k``; unequal heads without ``enable_gqa`` refused, as torch's."""
    if q.shape[1] != k.shape[-2] and not enable_gqa:
        raise ValueError(
            f"Expect query and key/value to have the same number of heads, got "
            f"Hq={q.shape[1]} and Hkv={k.shape[-2]}"
        )
    out, bounds = torch.empty_like(q), cu_q.tolist()
    for i in range(len(bounds) - 1):
        qi = q[bounds[i] : bounds[i + 1]]
        if block_table is None:
            assert cu_k is not None
            ki, vi = k[int(cu_k[i]) : int(cu_k[i + 1])], v[int(cu_k[i]) : int(cu_k[i + 1])]
        else:
            assert seqused_k is not None
            n = int(seqused_k[i])
            blocks = block_table[i, : -(-n // k.shape[1])].long()
            ki, vi = k[blocks].flatten(0, 1)[:n], v[blocks].flatten(0, 1)[:n]
        rows = torch.arange(qi.shape[0])[:, None] + ki.shape[0] - qi.shape[0]
        cols = torch.arange(ki.shape[0])[None, :]
        mask = cols <= rows
        if window_size[0] >= 0:
            mask &= cols >= rows - window_size[0]
        attended = F.scaled_dot_product_attention(
            qi.transpose(0, 1).float(),
            ki.transpose(0, 1).float(),
            vi.transpose(0, 1).float(),
            attn_mask=mask,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        out[bounds[i] : bounds[i + 1]] = attended.transpose(0, 1).to(q.dtype)
    return out


def varlen_attn_2_14(  # torch 2.14's signature
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux: Any = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    return _varlen(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        scale=scale,
        window_size=window_size,
        enable_gqa=enable_gqa,
        seqused_k=seqused_k,
        block_table=block_table,
    )


def varlen_attn_2_11(  # torch 2.11's: no enable_gqa (its TypeError on an H200), no paging
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    return_aux: Any = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
) -> torch.Tensor:
    return _varlen(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        scale=scale,
        window_size=window_size,
        enable_gqa=False,
        seqused_k=None,
        block_table=None,
    )


# the fake of each release this range's CI installs (.venv: the pin; scripts/lowest-torch:
# the lower bound); test_the_fake_of_the_installed_torch_has_its_real_signature keeps them true
FAKE_OF_RELEASE = {"2.14": varlen_attn_2_14, "2.11": varlen_attn_2_11}


def _params(fn: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_the_fake_of_the_installed_torch_has_its_real_signature() -> None:
    """The fakes are not written from memory: the one of the installed release (CI runs this
    file on the pinned torch and, through scripts/lowest-torch, on the lowest) must have the
    real ``varlen_attn``'s parameters, kinds and defaults."""
    from torch.nn.attention.varlen import varlen_attn

    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    fake = FAKE_OF_RELEASE.get(release)
    assert fake is not None, (
        f"torch {torch.__version__}: add its varlen_attn signature to FAKE_OF_RELEASE "
        f"({inspect.signature(varlen_attn)})"
    )
    assert _params(fake) == _params(varlen_attn)


def varlen_attn_unpaged(  # no enable_gqa, no paged reads
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
) -> torch.Tensor:
    return _varlen(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        scale=scale,
        window_size=window_size,
        enable_gqa=False,
        seqused_k=None,
        block_table=None,
    )


def _loader(kernel: VarlenKernel) -> Callable[[], VarlenKernel]:
    return lambda: kernel


def _changed(name: str, change: Callable[[Any, dict[str, Any]], Any]) -> VarlenKernel:
    """torch 2.14's kernel with ``change(result, keywords)`` applied to each call."""
    good = torch_varlen_kernel(varlen_attn_2_14).run

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        return change(lambda **over: good(q, k, v, **{**kw, **over}), kw)

    return VarlenKernel(name, run)


def _step_output(backend: Any, shape: ProbeShape, block: int) -> torch.Tensor:
    """``backend.attend`` on a mixed step (prefill, chunk on cached context, decodes) over
    shuffled blocks, window 5; compared by the callers with :class:`TorchBackend`."""
    gen = torch.Generator().manual_seed(3)
    spec = KVCacheSpec(1, shape.num_kv_heads, shape.head_dim, shape.dtype, CPU, block)
    pool = PagedKVPool(spec, num_blocks=16)
    for cache in (pool.key_cache[0], pool.value_cache[0]):
        cache.copy_(torch.randn(cache.shape, generator=gen).to(shape.dtype))
    starts, lens = [0, block + 2, 2 * block - 1], [6, 4, 1]
    free = list(range(1, 16))
    random.Random(3).shuffle(free)
    tables = [
        [free.pop() for _ in range(-(-(s + n) // block))] for s, n in zip(starts, lens, strict=True)
    ]
    meta = AttentionMetadata.build(lens, starts, tables, block, pool.num_slots, CPU)
    q = torch.randn(sum(lens), shape.num_heads, shape.head_dim, generator=gen).to(shape.dtype)
    new_k, new_v = pool.flat_keys(0)[meta.slot_mapping], pool.flat_values(0)[meta.slot_mapping]
    args = (q, pool.key_cache[0], pool.value_cache[0], new_k, new_v, meta, 0.25, 5)
    return backend.attend(*args)


# -- each known signature -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fake", "block", "paged"),
    [
        (varlen_attn_2_14, 16, False),  # block size not a multiple of 256: packed
        (varlen_attn_2_14, 256, True),  # native GQA + block_table: paged reads
        (varlen_attn_2_11, 16, False),
        (varlen_attn_2_11, 256, False),  # GQA without enable_gqa: never repeat the pool
        (varlen_attn_unpaged, 256, False),  # no block_table at all
    ],
)
def test_each_known_signature_is_probed_and_attends_like_sdpa(
    fake: Callable[..., torch.Tensor], block: int, paged: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """torch 2.11's ``varlen_attn`` (no ``enable_gqa``, the H200's ``TypeError``) and 2.14's
    both pass the probe for a GQA model and then attend like torch SDPA: without
    ``enable_gqa`` the heads arrive repeated (the fake refuses unequal heads)."""
    with caplog.at_level(logging.INFO, logger=LOGGER):
        backend = select_backend(CPU, block, shape=GQA, kernels=[lambda: torch_varlen_kernel(fake)])
    assert isinstance(backend, VarlenBackend) and backend.name == "torch-varlen"
    assert backend.paged == paged and backend.broken is None
    assert f"attention: torch-varlen ({'paged' if paged else 'packed'} reads" in caplog.text
    got = _step_output(backend, GQA, block)
    assert backend.broken is None, backend.broken  # the kernel ran, no silent fallback
    torch.testing.assert_close(got, _step_output(TorchBackend(), GQA, block), atol=3e-2, rtol=0)


def test_torch_2_11_varlen_never_reads_pages_even_for_equal_heads() -> None:
    """2.11's ``varlen_attn`` takes no ``block_table``: its varlen path always gathers (on
    that torch FlexAttention is what reads the pool in place, ``test_flex_backend.py``)."""
    mha = ProbeShape(num_heads=2, num_kv_heads=2, head_dim=16, dtype=torch.float16)
    kernel = torch_varlen_kernel(varlen_attn_2_11)
    assert not kernel.paged_reads and not kernel.native_gqa
    backend = select_backend(CPU, 256, shape=mha, kernels=[_loader(kernel)])
    assert isinstance(backend, VarlenBackend) and not backend.paged
    torch.testing.assert_close(
        _step_output(backend, mha, 256), _step_output(TorchBackend(), mha, 256), atol=1e-2, rtol=0
    )


# -- rejections: the next candidate, the reason logged --------------------------------------
def _unadapted(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
    """The call the engine made before the probe: 2.14's keywords, on torch 2.11."""
    return varlen_attn_2_11(  # type: ignore[call-arg]
        q,
        k,
        v,
        kw["cu_seqlens_q"],
        kw["cu_seqlens_k"],
        kw["max_seqlen_q"],
        kw["max_seqlen_k"],
        scale=kw["scale"],
        window_size=(kw["window"], 0),
        enable_gqa=q.shape[1] != k.shape[-2],
        seqused_k=None,
        block_table=None,
    )


def _raises(*_: Any, **__: Any) -> torch.Tensor:
    raise RuntimeError("CUDA error: no kernel image is available for execution on the device")


def _max_head_dim(limit: int) -> VarlenKernel:
    good = torch_varlen_kernel(varlen_attn_2_14).run

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        if q.shape[-1] > limit:
            raise RuntimeError(f"FlashAttention forward only supports head dimension <= {limit}")
        return good(q, k, v, **kw)

    return VarlenKernel("small-heads", run)


def _pages_of(size: int) -> VarlenKernel:
    good = torch_varlen_kernel(varlen_attn_2_14).run

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        if kw["block_table"] is not None and k.shape[1] != size:
            raise RuntimeError(f"Paged KV cache block size must be {size}")
        return good(q, k, v, **kw)

    return VarlenKernel("pages-of-256", run)


REJECTED = {
    # name: (kernel, probed shape, block size, the logged reason)
    "2.14 call on torch 2.11": (
        VarlenKernel("torch-varlen", _unadapted),
        GQA,
        16,
        "TypeError: varlen_attn_2_11() got an unexpected keyword argument 'enable_gqa'",
    ),
    "raises on first call": (
        VarlenKernel("flash-attn", _raises),
        GQA,
        16,
        "RuntimeError: CUDA error: no kernel image",
    ),
    "ignores the window": (
        _changed("no-window", lambda call, kw: call(window=-1)),
        GQA,
        16,
        "differs from torch SDPA by",
    ),
    "ignores the scale": (
        _changed("no-scale", lambda call, kw: call(scale=None)),
        GQA,
        16,
        "differs from torch SDPA by",
    ),
    "wrong numbers": (
        _changed("half", lambda call, kw: call() * 0.5),
        GQA,
        16,
        "differs from torch SDPA by",
    ),
    "NaN": (
        _changed("nan", lambda call, kw: call() * float("nan")),
        GQA,
        16,
        "differs from torch SDPA by nan",
    ),
    "wrong shape": (
        _changed("shape", lambda call, kw: call()[:, :1]),
        GQA,
        16,
        "it returned shape",
    ),
    "head size": (
        _max_head_dim(64),
        ProbeShape(4, 2, 128, torch.bfloat16),
        16,
        "supports head dimension <= 64",
    ),
    "page size": (
        _pages_of(256),
        GQA,
        512,
        "Paged KV cache block size must be 256",
    ),
    "dtype": (
        torch_varlen_kernel(varlen_attn_2_14),
        ProbeShape(4, 2, 16, torch.float32),
        16,
        "flash kernels run in float16/bfloat16 only; the model is torch.float32",
    ),
}


@pytest.mark.parametrize("case", list(REJECTED))
def test_a_kernel_that_fails_the_probe_gives_way_to_the_next(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    kernel, shape, block, reason = REJECTED[case]
    nxt = VarlenKernel("next", torch_varlen_kernel(varlen_attn_2_14).run)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        backend = select_backend(CPU, block, shape=shape, kernels=[_loader(kernel), _loader(nxt)])
    assert f"attention: {kernel.name} failed the start-up probe (" in caplog.text
    assert reason in caplog.text
    if shape.dtype == torch.float32:  # no flash kernel serves it: torch SDPA
        assert isinstance(backend, TorchBackend)
        assert "no paged or varlen kernel usable on cpu; torch SDPA" in caplog.text
    else:
        assert isinstance(backend, VarlenBackend) and backend.name == "next"
        assert "attention: next (" in caplog.text


def test_the_probe_passes_the_capabilities_a_kernel_has() -> None:
    """The same limited kernels pass where the model stays within their limits."""
    small = ProbeShape(4, 2, 64, torch.bfloat16)
    assert select_backend(CPU, 16, shape=small, kernels=[_loader(_max_head_dim(64))]).name == (
        "small-heads"
    )
    assert select_backend(CPU, 256, shape=GQA, kernels=[_loader(_pages_of(256))]).name == (
        "pages-of-256"
    )


def test_no_candidate_left_is_torch_sdpa(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        backend = select_backend(
            CPU, 16, shape=GQA, kernels=[lambda: None, _loader(VarlenKernel("x", _raises))]
        )
    assert isinstance(backend, TorchBackend)
    assert "attention: x failed the start-up probe (RuntimeError" in caplog.text
    assert "no paged or varlen kernel usable on cpu; torch SDPA" in caplog.text


def test_cpu_and_the_torch_name_never_load_a_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    def load() -> VarlenKernel:
        raise AssertionError("a kernel was loaded")

    monkeypatch.setattr(varlen_backend, "KERNELS", (load,))
    assert type(select_backend(CPU, 16, shape=GQA)) is TorchBackend
    assert type(select_backend(torch.device("cuda"), 256, "torch")) is TorchBackend
    assert type(select_backend(CPU, 16, "torch", kernels=[load])) is TorchBackend


# -- the start-up self-check on the chosen backend ------------------------------------------
@pytest.mark.model
def test_a_self_check_failure_on_a_flash_backend_moves_the_runner_to_torch_sdpa(
    tiny_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """A kernel that passes the probe, runs the tiny model's steps (bf16: flash's dtypes) and
    passes the self-check; then gives wrong numbers: the self-check fails on it, switches the
    runner to torch SDPA (logged, with why) and passes there."""
    adapter = load_adapter(tiny_dirs["llava"], "cpu", torch.bfloat16)
    state = {"calls": 0, "wrong": False}
    good = torch_varlen_kernel(varlen_attn_2_14).run

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        state["calls"] += 1
        out = good(q, k, v, **kw)
        return out.flip(0) if state["wrong"] else out  # each row gets another row's output

    backend = select_backend(
        CPU, 16, shape=ProbeShape.of(adapter), kernels=[_loader(VarlenKernel("fake", run))]
    )
    assert isinstance(backend, VarlenBackend)
    runner = ModelRunner(adapter, PagedKVPool(adapter.kv_cache_spec(16), 32), backend=backend)
    probed = state["calls"]
    assert run_self_check(runner) <= TOLERANCE[torch.bfloat16]
    assert runner.backend is backend and backend.broken is None
    assert state["calls"] > probed  # the model's own steps ran the kernel
    state["wrong"] = True
    with caplog.at_level(logging.WARNING, logger="mmis.engine.self_check"):
        assert run_self_check(runner) <= TOLERANCE[torch.bfloat16]
    assert isinstance(runner.backend, TorchBackend)
    assert "self-check failed on attention backend fake (" in caplog.text
    assert "differs from transformers'" in caplog.text
    assert "switching to torch SDPA and checking again" in caplog.text
