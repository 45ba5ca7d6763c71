"""KV memory at the boundary of a real ``mmis engine`` with a tiny, preallocated KV pool.

The pool is sized from ``--kv-cache-gb`` (LLaVA) or ``--num-kv-blocks`` (the other
families) to 12 blocks of 16 tokens (11 usable): requests that do not fit together are queued
or preempted and still give tokens identical to ``generate()``; a request that can never fit
gets an error output while the others are served; aborting running requests frees their
blocks.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_harness import EngineHarness
from engine_inputs import ModelKit, image, kit_for

from mmis.config import GiB

pytestmark = [pytest.mark.model, pytest.mark.slow]

# LLaVA (the --kv-cache-gb sizing) and Qwen2-VL (M-RoPE positions on preemption and recompute);
# Qwen2.5-VL's language model is Qwen2-VL's and LLaVA-SigLIP's is LLaVA's (another tower only),
# so they take these paths again: their greedy parity is test_engine_parity's
FAMILIES = ("llava", "qwen2-vl")
NUM_BLOCKS, BLOCK_SIZE = 12, 16
USABLE_TOKENS = (NUM_BLOCKS - 1) * BLOCK_SIZE
TEXTS = [
    "Describe this image in one short sentence, please.",
    "What is in the picture? A red square, a blue circle and a green line.",
    "A cat sits on a warm mat near the window while it rains outside.",
    "The quick brown fox jumps over the lazy dog.",
    "Hello, how are you today? I am fine, thank you very much!",
    "The model answers questions about images and text.",
]


def block_bytes(kit: ModelKit) -> int:
    """Bytes of one KV block, computed from the checkpoint's config (float32 on CPU)."""
    text = kit.hf_model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * BLOCK_SIZE * text.num_key_value_heads * head_dim * 4


@pytest.fixture(scope="module", params=FAMILIES)
def kit(request: pytest.FixtureRequest, tiny_dirs: dict[str, Path]) -> ModelKit:
    return kit_for(request.param, tiny_dirs[request.param])


@pytest.fixture(scope="module")
def engine(kit: ModelKit) -> Iterator[EngineHarness]:
    if kit.family == "llava":
        sizing = ["--kv-cache-gb", repr(NUM_BLOCKS * block_bytes(kit) / GiB)]
    else:
        sizing = ["--num-kv-blocks", str(NUM_BLOCKS)]
    with EngineHarness(kit.path, *sizing, "--block-size", str(BLOCK_SIZE)) as eng:
        yield eng


def assert_all_blocks_free(engine: EngineHarness) -> None:
    stats = engine.call("stats")
    assert (stats["num_running"], stats["num_waiting"]) == (0, 0), stats
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"], stats


def test_kv_pool_is_preallocated_from_the_configured_size(
    kit: ModelKit, engine: EngineHarness
) -> None:
    stats = engine.call("stats")
    assert stats["kv_block_bytes"] == block_bytes(kit)
    assert stats["num_kv_blocks"] == NUM_BLOCKS - 1  # block 0 is the reserved null block
    assert f"engine ready: {NUM_BLOCKS} KV blocks of {BLOCK_SIZE} tokens" in engine.log_text()


def test_requests_that_do_not_fit_together_are_preempted_and_still_match(
    kit: ModelKit, engine: EngineHarness
) -> None:
    before = engine.call("stats")
    specs = [(text, [image(1100 + i)], 24) for i, text in enumerate(TEXTS)]
    requests = [kit.request(t, imgs, max_tokens=m) for t, imgs, m in specs]
    needed = sum(len(r.prompt_token_ids) + 24 for r in requests)
    assert needed > 2 * USABLE_TOKENS  # they cannot all hold their KV at once
    results = engine.run(*requests)
    for res, (text, images, max_tokens) in zip(results, specs, strict=True):
        assert res.error is None, res.error
        assert res.token_ids == kit.reference(text, images, max_tokens)
    after = engine.call("stats")
    assert after["num_preemptions"] > before["num_preemptions"]
    assert_all_blocks_free(engine)


def test_request_that_can_never_fit_is_refused_and_others_are_served(
    kit: ModelKit, engine: EngineHarness
) -> None:
    huge = kit.request(" ".join(TEXTS * 3), max_tokens=4)
    assert len(huge.prompt_token_ids) > USABLE_TOKENS
    images = [image(1200)]
    small = [kit.request(TEXTS[0], images, max_tokens=8), kit.request(TEXTS[3], max_tokens=8)]
    # fits as a prompt, but not with all its output: it stops where the pool ends
    grower = kit.request(" ".join(TEXTS[:3]), max_tokens=USABLE_TOKENS)
    results = engine.run(small[0], huge, grower, small[1])
    refused = results[1]
    assert refused.error is not None and refused.error.code == "context_length_exceeded"
    assert refused.finish_reason == {0: "error"} and refused.token_ids == []
    assert results[0].token_ids == kit.reference(TEXTS[0], images, 8)
    assert results[3].token_ids == kit.reference(TEXTS[3], [], 8)
    grown = results[2]
    assert grown.error is None and grown.finish_reason == {0: "length"}
    assert 0 < len(grown.token_ids) < USABLE_TOKENS
    # it ran until its next token had no KV slot left (the last sampled token needs none)
    assert len(grower.prompt_token_ids) + len(grown.token_ids) == USABLE_TOKENS + 1
    expected = kit.reference(" ".join(TEXTS[:3]), [], len(grown.token_ids))
    assert grown.token_ids == expected
    assert engine.alive
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("n", [1, 3])
def test_abort_of_running_requests_frees_their_blocks(
    kit: ModelKit, engine: EngineHarness, n: int
) -> None:
    prompt_len = len(kit.request(TEXTS[3]).prompt_token_ids)
    per_choice = (NUM_BLOCKS - 1) // n * BLOCK_SIZE  # all n choices fit: no preemption
    # n choices are n requests, as P0 sends them
    reqs = [kit.request(TEXTS[3], max_tokens=per_choice - prompt_len) for _ in range(n)]
    engine.send(*reqs)
    results = [engine.results[req.request_id] for req in reqs]
    engine.wait_until(lambda: all(res.tokens.get(0) for res in results))
    assert not any(res.done for res in results), "a request finished before the abort"
    running = engine.call("stats")
    assert running["num_running"] == n
    assert running["num_free_kv_blocks"] < running["num_kv_blocks"]
    engine.abort([req.request_id for req in reqs])
    assert_all_blocks_free(engine)
