"""FlexAttention over the paged pool (``engine/execution/flex_backend.py``), on CPU.

- The compiled kernel (torch's C++ template of FlexAttention here, the same block mask and
  ``mask_mod`` as Triton's on CUDA) equals :class:`TorchBackend` on one step holding every
  case at once: a fresh prefill, a chunk on cached context across block boundaries, a chunk
  with a bidirectional span (Gemma 3's image tokens), and decode rows of different lengths
  padded to a bucket; without and with a sliding window; at block sizes 16 (the server's
  default) and 256. Every pool block no sequence holds is poisoned with NaN values: a block
  the kernel visits outside its rows' tables turns the output NaN, so this also proves that
  the step reads only its own blocks, in place.
- ``mask_mod`` alone is exact: eager FlexAttention (which ignores the block lists and scores
  every slot of the pool) gives the same output.
- On real tiny models, greedy decoding with the flex backend (eager kernel: the mask is what
  is under test there; the compiled kernel's parity is the first point) runs in lockstep with
  the torch backend: every step's tokens and log-probabilities and every KV block, for
  LLaVA, Qwen2-VL (M-RoPE, an image), Gemma 3 (past its sliding window), and for the static
  decode steps that CUDA graphs replay.
- ``--attention-backend flex`` is chosen by name on any device; ``auto`` keeps torch SDPA on
  CPU.

The lowest-torch run (``scripts/lowest-torch test``) runs this file on torch 2.11 too.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_decode_graphs import add_requests, driver, lockstep

from mmis.engine.execution.attn_backends import ProbeShape, TorchBackend, select_backend
from mmis.engine.execution.attn_metadata import AttentionMetadata
from mmis.engine.execution.decode_graphs import DecodeGraphs, capture_sizes
from mmis.engine.execution.flex_backend import FlexBackend, bucket_rows
from mmis.engine.execution.model import load_adapter
from mmis.engine.execution.runner import ModelRunner
from mmis.protocol.messages import SamplingParams

CPU = torch.device("cpu")
H, KVH, D = 4, 2, 16
SCALE = 0.3
Driver = Any
Family = Any


Step = tuple[
    AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]


def _step(block_size: int, device: torch.device = CPU, dtype: torch.dtype = torch.float32) -> Step:
    """One step of every kind over shuffled blocks; blocks nobody holds hold NaN values."""
    bs, gen = block_size, torch.Generator().manual_seed(block_size)
    lens = [1, 1, 5, 20, 1, 37, 1, 1]  # 5 decode rows: padded to a bucket of 8
    starts = [bs + 3, 2, 0, bs - 5, 3 * bs // 2, 2 * bs + 1, 9, bs + 7]
    spans: list[tuple[tuple[int, int], ...]] = [(), (), ((1, 4),), ((bs - 3, bs + 6),)]
    spans += [(), (), (), ()]
    needed = [-(-(s + n) // bs) for s, n in zip(starts, lens, strict=True)]
    num_blocks = sum(needed) + 4  # 3 blocks no one holds, and the null block 0
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = [[free.pop() for _ in range(k)] for k in needed]
    keys = torch.randn(num_blocks, bs, KVH, D, generator=gen)
    values = torch.randn(num_blocks, bs, KVH, D, generator=gen)
    values[free] = float("nan")  # never read by a correct step
    keys, values = keys.to(device, dtype), values.to(device, dtype)
    meta = AttentionMetadata.build(lens, starts, tables, bs, num_blocks * bs, device, spans)
    query = torch.randn(meta.num_tokens, H, D, generator=gen).to(device, dtype)
    flat = (-1, KVH, D)
    new_key = keys.view(flat)[meta.slot_mapping]
    new_value = values.view(flat)[meta.slot_mapping]
    return meta, query, keys, values, new_key, new_value


@pytest.mark.parametrize("block_size", [16, 256])
def test_compiled_flex_equals_sdpa_and_reads_only_its_blocks(block_size: int) -> None:
    meta, query, keys, values, new_key, new_value = _step(block_size)
    flex = FlexBackend(block_size, CPU, TorchBackend())
    assert meta.decode is not None and bucket_rows(meta.decode.num) > meta.decode.num
    for window in (None, 7):
        want = TorchBackend().attend(query, keys, values, new_key, new_value, meta, SCALE, window)
        got = flex.attend(query, keys, values, new_key, new_value, meta, SCALE, window)
        assert flex.broken is None, flex.broken  # the compiled kernel ran: no fallback
        assert not got.isnan().any(), f"a block outside the step's tables was read ({window=})"
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("block_size", [16, 256])
def test_flex_on_cuda_equals_sdpa_and_reads_only_its_blocks(block_size: int) -> None:
    """The Triton kernels (decoding and prefill, whose KV tile must divide a 16-token block:
    torch 2.11 does not shrink it itself, ``FlexBackend.chunk_options``) in bfloat16."""
    cuda = torch.device("cuda")
    meta, query, keys, values, new_key, new_value = _step(block_size, cuda, torch.bfloat16)
    flex = FlexBackend(block_size, cuda, TorchBackend())
    for window in (None, 7):
        want = TorchBackend().attend(query, keys, values, new_key, new_value, meta, SCALE, window)
        got = flex.attend(query, keys, values, new_key, new_value, meta, SCALE, window)
        assert flex.broken is None, flex.broken
        assert not got.isnan().any(), f"a block outside the step's tables was read ({window=})"
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=0)


def test_the_mask_alone_is_exact() -> None:
    """Eager FlexAttention scores every pool slot: only ``mask_mod`` keeps others out."""
    meta, query, keys, values, new_key, new_value = _step(16)
    values = torch.nan_to_num(values)  # eager reads every slot; a NaN would spread
    flex = FlexBackend(16, CPU, TorchBackend(), compiled=False)
    for window in (None, 7):
        want = TorchBackend().attend(query, keys, values, new_key, new_value, meta, SCALE, window)
        got = flex.attend(query, keys, values, new_key, new_value, meta, SCALE, window)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_a_kernel_that_fails_falls_back_for_good(caplog: pytest.LogCaptureFixture) -> None:
    meta, query, keys, values, new_key, new_value = _step(16)
    values = torch.nan_to_num(values)
    flex = FlexBackend(16, CPU, TorchBackend(), compiled=False)

    def no_kernel(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("CppCompileError: C++ compile error")

    flex.flex = no_kernel
    args = (query, keys, values, new_key, new_value, meta, SCALE, None)
    with caplog.at_level(logging.WARNING):
        got = flex.attend(*args)
    assert flex.broken is not None and "CppCompileError" in flex.broken
    assert "flex attention failed (RuntimeError: CppCompileError" in caplog.text
    torch.testing.assert_close(got, TorchBackend().attend(*args))


def test_selection_by_name(caplog: pytest.LogCaptureFixture) -> None:
    shape = ProbeShape(num_heads=H, num_kv_heads=KVH, head_dim=D, dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger="mmis.engine.execution.attn_backends"):
        chosen = select_backend(CPU, 16, "flex", shape=shape, compiled=False)
        assert isinstance(chosen, FlexBackend)
        assert "attention: flex (paged reads in place, block size 16)" in caplog.text
        assert isinstance(select_backend(CPU, 16, "auto", shape=shape), TorchBackend)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        select_backend(CPU, 16, "flash", shape=shape)


def _flex_runner(adapter: Any, block_size: int = 8, static: bool = False) -> ModelRunner:
    runner = ModelRunner.create(adapter, num_blocks=64, block_size=block_size)
    runner.backend = FlexBackend(block_size, CPU, TorchBackend(), compiled=False)
    if static:
        runner.decode_graphs = DecodeGraphs(
            adapter, runner.pool, runner.backend, capture_sizes(8), 256
        )
    return runner


@pytest.mark.model
@pytest.mark.parametrize("family", ["llava", "qwen2-vl"], indirect=True)
@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_flex_decodes_in_lockstep_with_sdpa(
    family: Family, driver_cls: type[Driver], static: bool
) -> None:
    torch_runner = ModelRunner.create(family.adapter, num_blocks=64, block_size=8)
    reference = driver(driver_cls, torch_runner)
    flex = driver(driver_cls, _flex_runner(family.adapter, static=static))
    add_requests(family, reference, flex)
    buckets = lockstep(reference, flex, {"atol": 1e-4, "rtol": 1e-4})
    assert bool(buckets) == static, buckets  # the static runs took the fixed-shape path


@pytest.mark.model
def test_flex_past_the_sliding_window(tiny_dirs: dict[str, Path], driver_cls: type[Driver]) -> None:
    adapter = load_adapter(tiny_dirs["gemma3"], "cpu", torch.float32)
    window = adapter.text_config.sliding_window
    reference = driver(driver_cls, ModelRunner.create(adapter, num_blocks=64, block_size=8))
    flex = driver(driver_cls, _flex_runner(adapter))
    greedy = SamplingParams(temperature=0.0, logprobs=3)
    for d in (reference, flex):  # contexts from 21 to 52 tokens around a 32-token window,
        for k, length in enumerate((40, 20, 27)):  # prompts in chunks on cached context
            prompt = [2, *range(10 + k, 10 + k + length - 1)]
            d.add(f"r{k}", prompt, [], max_tokens=12, chunk=9, sampling=greedy)
    buckets = lockstep(reference, flex, {"atol": 1e-4, "rtol": 1e-4})
    assert not buckets
    assert max(len(r.tokens) for r in reference.requests) > window + 16
