"""KV sizing profiles the worst case serving meets (``engine/execution/kv_sizing.py``): a
maximal encoder batch, the sampler with the largest logprobs, prompt logprobs over the
longest chunk, and the CUDA graph pool captured after sizing.

On CPU, with real profiling steps of the tiny models: the device's memory is
``live_memory.LiveMemory``, which *measures* each profiling run (the bytes of the tensors its
ops create, at their peak), so each part of the worst case shows as the allocations it
really makes. Each test sizes the pool with that part and without it: the part must lower
the pool (removing it from the profile makes the two equal, and the test fail).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, cast

import msgspec
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from live_memory import LiveMemory

from mmis.engine.config import MIN_ENCODER_CACHE_TOKENS, EngineConfig
from mmis.engine.execution.attn_backends import select_backend
from mmis.engine.execution.decode_graphs import capture_sizes
from mmis.engine.execution.encoder_sizing import encoder_batch, largest_item, load_image_processor
from mmis.engine.execution.kv_sizing import (
    GRAPH_SEGMENT_BYTES,
    WORST_SAMPLING,
    WorstCase,
    gpu_kv_blocks,
    graph_pool_bytes,
    profile_histories,
    profile_step,
    worst_case,
)
from mmis.engine.execution.model import ModelAdapter, load_adapter
from mmis.engine.scheduling.sampling_params import MAX_LOGPROBS

if TYPE_CHECKING:
    from mmis.engine.execution.tensor_parallel import TensorParallel

pytestmark = pytest.mark.model

BLOCK = 16
MAX_LEN = 512
NO_PROMPT_LOGPROBS = msgspec.structs.replace(WORST_SAMPLING, prompt_logprobs=None)


@pytest.fixture(scope="module")
def llava(tiny_dirs: dict[str, Path]) -> ModelAdapter:
    return load_adapter(tiny_dirs["llava"], "cpu", torch.float32)


def blocks(
    adapter: ModelAdapter, worst: WorstCase, *, tokens: int, seqs: int
) -> tuple[int, list[int]]:
    """The pool ``gpu_kv_blocks`` sizes at 0.5 of 1 GiB, nothing in use; and the peaks."""
    memory = LiveMemory(0, 1 << 30)
    num_blocks, _, _ = gpu_kv_blocks(
        adapter,
        0.5,
        block_size=BLOCK,
        max_num_batched_tokens=tokens,
        max_num_seqs=seqs,
        max_model_len=MAX_LEN,
        memory=memory,
        worst=worst,
    )
    return num_blocks, memory.peaks


def test_a_maximal_encoder_batch_lowers_the_pool(
    llava: ModelAdapter, tiny_dirs: dict[str, Path]
) -> None:
    item = largest_item(llava, load_image_processor(str(tiny_dirs["llava"]), None))
    assert item is not None and item.tokens == 16
    copies = encoder_batch(MIN_ENCODER_CACHE_TOKENS, item.tokens)
    assert copies == 512  # the per-step encoder budget's worth of the largest item
    worst = WorstCase(encoder_item=item, encoder_items=copies, sampling=None)
    # the profiling step really encodes every copy, each reached by its sequence's chunk
    runner, step = profile_step(
        llava,
        num_tokens=2048,
        max_num_seqs=256,
        block_size=BLOCK,
        max_model_len=MAX_LEN,
        worst=worst,
    )
    out = runner.execute(step, profile_histories(step))
    assert len(out.encoded_mm_hashes) == copies and runner.num_encoder_calls == 1
    assert step.num_scheduled_tokens == 2048 and len(step.scheduled) == 256
    with_images, peaks = blocks(llava, worst, tokens=2048, seqs=256)
    text_only, text_peaks = blocks(llava, WorstCase(sampling=None), tokens=2048, seqs=256)
    assert with_images < text_only
    outputs = copies * item.tokens * llava.hidden_size * 4  # held through the forward
    assert peaks[-1] - text_peaks[-1] >= outputs


def test_the_sampler_with_the_largest_logprobs_lowers_the_pool(llava: ModelAdapter) -> None:
    assert WORST_SAMPLING.logprobs == MAX_LOGPROBS
    # 256 one-token rows: the sampler's [256, V] work outweighs the forward's
    sampled, peaks = blocks(llava, WorstCase(sampling=NO_PROMPT_LOGPROBS), tokens=256, seqs=256)
    greedy, greedy_peaks = blocks(llava, WorstCase(sampling=None), tokens=256, seqs=256)
    assert sampled < greedy
    rows = 256 * llava.vocab_size * 4  # one float32 [256, V]
    assert peaks[-1] - greedy_peaks[-1] >= 2 * rows
    no_logprobs = msgspec.structs.replace(NO_PROMPT_LOGPROBS, logprobs=None)
    without, _ = blocks(llava, WorstCase(sampling=no_logprobs), tokens=256, seqs=256)
    assert sampled < without  # the logprobs' [256, V] log-softmax is held through the draw


def test_prompt_logprobs_over_the_longest_chunk_lower_the_pool(llava: ModelAdapter) -> None:
    # the first sequence is as long as max_model_len allows: its N x V logits are the worst
    _, step = profile_step(
        llava,
        num_tokens=2048,
        max_num_seqs=256,
        block_size=BLOCK,
        max_model_len=MAX_LEN,
        worst=WorstCase(),
    )
    lengths = [s.num_tokens for s in step.scheduled]
    assert lengths[:4] == [MAX_LEN, MAX_LEN, MAX_LEN, 260] and set(lengths[4:]) == {1}
    assert len(lengths) == 256 and sum(lengths) == 2048
    scored, _ = blocks(llava, WorstCase(), tokens=MAX_LEN, seqs=1)
    unscored, _ = blocks(llava, WorstCase(sampling=NO_PROMPT_LOGPROBS), tokens=MAX_LEN, seqs=1)
    assert scored < unscored


def test_the_cuda_graph_pool_is_reserved(llava: ModelAdapter) -> None:
    worst = WorstCase(sampling=None)
    graphs, peaks = blocks(
        llava, dataclasses.replace(worst, decode_graphs=True), tokens=256, seqs=64
    )
    eager, eager_peaks = blocks(llava, worst, tokens=256, seqs=64)
    assert len(peaks) == 2 and len(eager_peaks) == 1  # the largest bucket measured, then the step
    sizes = capture_sizes(64)
    pool = peaks[0] + sum(sizes[:-1]) * llava.hidden_size * 4 + GRAPH_SEGMENT_BYTES * len(sizes)
    per_block = llava.kv_cache_spec(BLOCK).bytes_per_block
    # room - max(step, G) - G: at least G fewer bytes
    assert eager - graphs >= pool // per_block
    # the same G, measured alone: the largest bucket's padded static step really ran
    backend = select_backend(llava.device, BLOCK)
    alone = LiveMemory(0, 1)
    measured = graph_pool_bytes(
        llava, backend, alone, block_size=BLOCK, max_num_seqs=64, max_model_len=MAX_LEN
    )
    assert measured == pool and alone.peaks == [peaks[0]] and peaks[0] > 0


def test_the_engine_worst_case_follows_the_settings(
    llava: ModelAdapter, tiny_dirs: dict[str, Path]
) -> None:
    item = largest_item(llava, load_image_processor(str(tiny_dirs["llava"]), None))
    assert item is not None
    worst = worst_case(EngineConfig(), item, None)
    assert (worst.encoder_items, worst.sampling, worst.decode_graphs) == (512, WORST_SAMPLING, True)
    assert worst_case(EngineConfig(encoder_cache_tokens=40), item, None).encoder_items == 2
    assert worst_case(EngineConfig(encoder_cache_tokens=8), item, None).encoder_items == 0
    assert not worst_case(EngineConfig(enforce_eager=True), item, None).decode_graphs
    tp = cast("TensorParallel", object())  # every rank runs eager: no graphs
    assert not worst_case(EngineConfig(), item, tp).decode_graphs
    assert worst_case(EngineConfig(), None, None).encoder_items == 0
