"""Static decode steps and CUDA graphs (``engine/execution/decode_graphs.py``).

- CPU: the static path (fixed shapes, padded to a bucket, no capture) runs in lockstep with
  the eager runner on real tiny models: LLaVA (1-D positions), Qwen2-VL (M-RoPE, an image
  before the decode rows), Gemma 3 (contexts past its 32-token sliding window). Each step's
  sampled tokens and log-probabilities, and every KV block but the null block 0, must agree:
  a padding row writing a real slot, or a mask ignoring ``seq_lens``, fails it (the padding
  case is checked here by breaking the null slot on purpose).
- Which steps qualify (prefill, chunks, images, pooling stay eager), the buckets, the
  start-up verification failing on a wrong forward, and ``setup`` staying off on CPU.
- ``@pytest.mark.cuda`` (``scripts/gpu-check``): capture and replay parity on CUDA, float32
  and bfloat16, off with ``enforce_eager`` / tensor parallelism, and a real ``mmis engine``
  on CUDA logging its capture line and answering as the eager runner does.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_harness import EngineHarness

from mmis.engine.execution import decode_graphs
from mmis.engine.execution.attn_backends import TorchBackend
from mmis.engine.execution.decode_graphs import (
    DecodeGraphError,
    DecodeGraphs,
    capturable_sizes,
    capture_sizes,
    qualifies,
)
from mmis.engine.execution.flex_backend import FlexBackend
from mmis.engine.execution.model import load_adapter
from mmis.engine.execution.model.adapter import ModelAdapter
from mmis.engine.execution.paged_attention import KVCacheSpec, PagedKVPool
from mmis.engine.execution.runner import ModelRunner
from mmis.engine.execution.varlen_backend import VarlenBackend
from mmis.engine.scheduling.sched_output import MultiModalInput, ScheduledRequest
from mmis.protocol.messages import EngineCoreRequest, PoolingParams, SamplingParams

CUDA = pytest.mark.cuda  # skipped without a device (tests/conftest.py); scripts/gpu-check runs them
GREEDY = SamplingParams(temperature=0.0, logprobs=3)
MAX_LEN = 256


def static_runner(adapter: ModelAdapter, block_size: int = 8) -> ModelRunner:
    runner = ModelRunner.create(adapter, num_blocks=64, block_size=block_size)
    runner.decode_graphs = DecodeGraphs(
        adapter, runner.pool, runner.backend, capture_sizes(8), MAX_LEN
    )
    return runner


Driver = Any  # tests/engine/conftest.py's Driver, through the driver_cls fixture
Family = Any  # tests/engine/conftest.py's Family, through the family fixture


def driver(driver_cls: type[Driver], runner: ModelRunner) -> Driver:
    d = driver_cls(runner)
    d.next_block = 1  # block 0 is the null block, as the scheduler keeps it
    return d


def lockstep(eager: Driver, static: Driver, tol: dict[str, float] | None = None) -> list[int]:
    """Step both until done; every step must agree. Returns the buckets of static steps
    (none when ``static``'s runner has no ``decode_graphs``: two eager runners compared)."""
    graphs = static.runner.decode_graphs
    tol = tol or {"atol": 1e-5, "rtol": 1e-5}
    buckets = []
    while not all(r.done for r in eager.requests):
        assert eager.steps < 100
        before = graphs.num_steps if graphs is not None else 0
        eager.step()
        static.step()
        if graphs is not None and graphs.num_steps > before:
            buckets.append(graphs.last_bucket)
        a, b = eager.outputs[-1], static.outputs[-1]
        assert a.sampled_token_ids == b.sampled_token_ids, (eager.steps, buckets)
        for rid, lp in a.logprobs.items():
            torch.testing.assert_close(
                torch.tensor(b.logprobs[rid].logprobs), torch.tensor(lp.logprobs), **tol
            )
        for pool_a, pool_b in zip(
            eager.runner.pool.key_cache + eager.runner.pool.value_cache,
            static.runner.pool.key_cache + static.runner.pool.value_cache,
            strict=True,
        ):
            torch.testing.assert_close(pool_b[1:], pool_a[1:], **tol)  # block 0: padding only
    return buckets


def add_requests(family: Family, *drivers: Driver) -> None:
    prompts = [("Describe this image.", 1, 0), ("Hello, how are you today?", 0, 0)]
    prompts.append(("A cat sits on a warm mat near the window.", 1, 2))
    for k, (text, num_images, join) in enumerate(prompts):
        ids, items, _ = family.request(text, [family.image(k)] * num_images)
        for d in drivers:
            d.add(f"r{k}", ids, items, max_tokens=6, join_step=join, sampling=GREEDY)


@pytest.mark.model
@pytest.mark.parametrize("family", ["llava", "qwen2-vl"], indirect=True)
def test_static_decode_matches_eager(family: Family, driver_cls: type[Driver]) -> None:
    eager = driver(driver_cls, ModelRunner.create(family.adapter, num_blocks=64, block_size=8))
    static = driver(driver_cls, static_runner(family.adapter))
    add_requests(family, eager, static)
    buckets = lockstep(eager, static)
    # 2 rows (a bucket), then 3 rows padded to 4 once the third joined, then the last alone
    assert buckets[0] == 2 and 4 in buckets and buckets[-1] == 1, buckets


@pytest.mark.model
@pytest.mark.parametrize("family", ["llava"], indirect=True)
def test_a_padding_row_writing_a_real_slot_is_caught(
    family: Family, driver_cls: type[Driver], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decode_graphs, "NULL_SLOT", 8)  # block 1: r0's first token
    eager = driver(driver_cls, ModelRunner.create(family.adapter, num_blocks=64, block_size=8))
    static = driver(driver_cls, static_runner(family.adapter))
    for d in (eager, static):  # 3 rows: one padding row in bucket 4
        for k in range(3):
            d.add(f"r{k}", list(range(5 + k, 12 + 3 * k)), [], max_tokens=3, sampling=GREEDY)
        d.next_block = 1
    with pytest.raises(AssertionError):
        lockstep(eager, static)


@pytest.mark.model
def test_static_decode_past_the_sliding_window(
    tiny_dirs: dict[str, Path], driver_cls: type[Driver]
) -> None:
    adapter = load_adapter(tiny_dirs["gemma3"], "cpu", torch.float32)
    window = adapter.text_config.sliding_window
    eager = driver(driver_cls, ModelRunner.create(adapter, num_blocks=64, block_size=8))
    static = driver(driver_cls, static_runner(adapter))
    for d in (eager, static):  # contexts from 21 to 52 tokens around a 32-token window
        for k, length in enumerate((40, 20, 27)):
            prompt = [2, *range(10 + k, 10 + k + length - 1)]
            d.add(f"r{k}", prompt, [], max_tokens=12, sampling=GREEDY)
    buckets = lockstep(eager, static)
    assert buckets == [4] * 11, buckets
    assert max(len(r.tokens) for r in eager.requests) > window + 16


def test_which_steps_qualify() -> None:
    def row(n: int = 1, start: int = 10, **kw: Any) -> ScheduledRequest:
        return ScheduledRequest(f"r{start}", [1] * n, start, [1, 2], **kw)

    image = MultiModalInput("h", offset=2, length=4)
    assert qualifies([row(), row(start=11, mm_items=[image])], 4)  # an image in the past
    assert not qualifies([], 4)
    assert not qualifies([row(start=s) for s in range(5)], 4)  # more rows than buckets hold
    assert not qualifies([row(), row(n=2, start=11)], 4)  # a prefill chunk
    assert not qualifies([row(start=4, mm_items=[image])], 4)  # on a placeholder
    assert not qualifies([row(start=3, mm_items=[image], encoder_inputs=[0])], 4)
    assert not qualifies([row(pooling_params=PoolingParams())], 4)
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(10_000)[-1] == 256 and capture_sizes(10_000)[5] == 24


@pytest.mark.model
@pytest.mark.parametrize("family", ["qwen2-vl"], indirect=True)
def test_verification_and_setup_on_cpu(family: Family, caplog: pytest.LogCaptureFixture) -> None:
    runner = static_runner(family.adapter)
    graphs = runner.decode_graphs
    assert graphs is not None
    assert graphs.verify() <= 1e-4  # the static path run eager, 3 rows padded to 4
    assert graphs.last_bucket == 4
    run = graphs._run
    graphs._run = lambda b: run(b) + 0.5  # type: ignore[method-assign]
    with pytest.raises(DecodeGraphError, match="differs from eager"):
        graphs.verify()
    with pytest.raises(DecodeGraphError, match="CUDA only"):
        graphs.capture()
    with caplog.at_level(logging.INFO, logger="mmis.engine.execution.decode_graphs"):
        assert cuda_setup(runner) is None
    assert "CUDA graphs: off (the device is cpu; only CUDA captures)" in caplog.text


def test_capturable_sizes_bound_the_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    def pool(dtype: torch.dtype, block_size: int) -> PagedKVPool:
        return PagedKVPool(KVCacheSpec(2, 2, 8, dtype, torch.device("cpu"), block_size), 65)

    fp32 = pool(torch.float32, 16)  # 128 bytes of K + V per token and layer
    ctx = 64 * 16  # max_model_len 1024 / 16 = 64 blocks (the pool has 65)
    monkeypatch.setattr(decode_graphs, "GATHER_BYTES", 4 * ctx * 128)
    assert capturable_sizes(fp32, TorchBackend(), 64, 1024) == [1, 2, 4]
    assert capturable_sizes(fp32, TorchBackend(), 64, 256)[-1] == 16  # ctx 256: 4x the rows
    paged = VarlenBackend(lambda *a, **kw: a[0], "fake", 256, TorchBackend())
    assert paged.paged
    assert capturable_sizes(pool(torch.bfloat16, 256), paged, 64, 1024) == capture_sizes(64)
    assert capturable_sizes(fp32, paged, 64, 1024) == [1, 2, 4]  # fp32: TorchBackend's path
    # FlexAttention reads the pool in place at any block size and dtype: every bucket
    flex = FlexBackend(16, torch.device("cpu"), TorchBackend(), compiled=False)
    assert capturable_sizes(fp32, flex, 256, 4096) == capture_sizes(256)
    flex.broken = "no kernel"  # fallen back to the gather: bounded like it
    assert capturable_sizes(fp32, flex, 64, 1024) == [1, 2, 4]


# -- CUDA (scripts/gpu-check) ------------------------------------------------------------------
def cuda_setup(runner: ModelRunner, **kw: Any) -> DecodeGraphs | None:
    args = {"enforce_eager": False, "max_num_seqs": 8, "max_model_len": MAX_LEN}
    args["tensor_parallel"] = False
    args.update(kw)
    return decode_graphs.setup(runner.adapter, runner.pool, runner.backend, **args)


@CUDA
@pytest.mark.model
@pytest.mark.parametrize("family", ["llava"], indirect=True)
def test_capture_and_replay_match_eager_on_cuda(family: Family, driver_cls: type[Driver]) -> None:
    adapter = load_adapter(family.path, "cuda", torch.float32)
    eager = driver(driver_cls, ModelRunner.create(adapter, num_blocks=64, block_size=8))
    runner = ModelRunner.create(adapter, num_blocks=64, block_size=8)
    graphs = cuda_setup(runner)
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8]
    runner.decode_graphs = graphs
    static = driver(driver_cls, runner)
    add_requests(family, eager, static)
    buckets = lockstep(eager, static, {"atol": 1e-4, "rtol": 1e-4})
    assert 4 in buckets
    assert cuda_setup(runner, enforce_eager=True) is None
    assert cuda_setup(runner, tensor_parallel=True) is None
    bf16 = load_adapter(family.path, "cuda", torch.bfloat16)
    bf16_runner = ModelRunner.create(bf16, num_blocks=64, block_size=256)  # paged kernel
    captured = cuda_setup(bf16_runner)
    assert captured is not None and sorted(captured.graphs) == [1, 2, 4, 8]


@CUDA
@pytest.mark.model
def test_engine_on_cuda_logs_its_capture(
    tiny_dirs: dict[str, Path], driver_cls: type[Driver]
) -> None:
    args = ["--device", "cuda", "--dtype", "float32", "--max-model-len", "256"]
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    requests = [EngineCoreRequest(f"g{i}", list(range(3, 20 + i)), [], params) for i in range(3)]
    with EngineHarness(tiny_dirs["llava"], *args, "--max-num-seqs", "4") as engine:
        assert "CUDA graphs: 3 decode batch sizes captured in" in engine.log_text()
        # no KV flag on CUDA: sized from memory, the step size from that profile
        assert "(--gpu-memory-utilization 0.9 (default)," in engine.log_text()
        assert "tokens a step (profile)" in engine.log_text()
        results = engine.run(*requests)
    assert all(r.error is None and len(r.token_ids) == 12 for r in results)
    adapter = load_adapter(tiny_dirs["llava"], "cuda", torch.float32)  # the eager reference
    runner = ModelRunner.create(adapter, num_blocks=64)
    eager = driver(driver_cls, runner)
    for r in requests:
        eager.add(r.request_id, r.prompt_token_ids, [], max_tokens=12, sampling=GREEDY)
    assert [r.token_ids for r in results] == list(eager.run().values())
