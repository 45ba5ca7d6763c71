"""Greedy parity: our batched, paged runner gives the token ids of ``generate(do_sample=False)``.

Runs for both families (LLaVA: 1-D RoPE; Qwen2-VL: M-RoPE), float32 on CPU.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.model

PROMPTS = [
    ("Describe this image.", 1),
    ("What is in the picture? Compare them.", 2),
    ("Hello, how are you today?", 0),
    ("A cat sits on a warm mat near the window while it rains outside.", 1),
]


def test_single_request_matches_generate(family, driver_cls):
    images = [family.image(1)]
    ids, items, _ = family.request("Describe this image.", images)
    driver = driver_cls(family.runner())
    driver.add("r", ids, items, max_tokens=16)
    got = driver.run()["r"]
    assert got == family.reference("Describe this image.", images, 16)
    # one prefill step, then one step per decoded token
    assert driver.runner.num_forwards == len(got)


def test_batched_requests_joining_at_different_steps(family, driver_cls):
    runner = family.runner(block_size=8)
    driver = driver_cls(runner)
    expected = {}
    for k, (text, num_images) in enumerate(PROMPTS):
        images = [family.image(10 * k + j, (64, 48 + 16 * j)) for j in range(num_images)]
        ids, items, _ = family.request(text, images)
        driver.add(f"r{k}", ids, items, max_tokens=10, join_step=[0, 0, 2, 5][k], chunk=24)
        expected[f"r{k}"] = family.reference(text, images, 10)
    calls = []
    hook = family.adapter.language_model.register_forward_hook(lambda *_: calls.append(1))
    try:
        got = driver.run()
    finally:
        hook.remove()
    assert got == expected
    assert driver.max_seqs_in_step == len(PROMPTS)  # they really ran together
    assert len(calls) == driver.steps  # one language-model forward per step, never per request


def test_chunked_prefill_splits_image_placeholders(family, driver_cls):
    images = [family.image(3), family.image(4, (48, 64))]
    text = "What is in the picture? Compare them."
    ids, items, _ = family.request(text, images)
    chunk = 5
    boundaries = set(range(chunk, len(ids), chunk))
    inside = [b for b in boundaries for it in items if it.offset < b < it.end]
    assert len(inside) >= 2, "the chunk size must cut through placeholder ranges"
    driver = driver_cls(family.runner(block_size=4))
    driver.add("r", ids, items, max_tokens=12, chunk=chunk)
    assert driver.run()["r"] == family.reference(text, images, 12)
    assert driver.steps > len(ids) // chunk  # the prompt really took several steps


def test_prefix_hit_reuses_kv_blocks(family, driver_cls):
    image = family.image(7)
    first_text = "Describe this image in one short sentence, please."
    second_text = "Describe this image. The quick brown fox jumps over the lazy dog."
    ids_a, items_a, _ = family.request(first_text, [image])
    ids_b, items_b, _ = family.request(second_text, [image])
    block = 4
    shared = 0
    while shared < min(len(ids_a), len(ids_b)) and ids_a[shared] == ids_b[shared]:
        shared += 1
    prefix_blocks = shared // block
    assert prefix_blocks * block > items_b[0].end, "the shared prefix must cover the image"

    runner = family.runner(block_size=block)
    driver = driver_cls(runner)
    driver.add("a", ids_a, items_a, max_tokens=6)
    driver.run()
    calls = runner.num_encoder_calls
    # b reuses a's blocks for the prefix; its image is covered, so it brings no tensors
    items_b = [it.__class__(it.mm_hash, it.offset, it.length, None, it.grid_thw) for it in items_b]
    driver.add("b", ids_b, items_b, max_tokens=8, prefix_from="a", prefix_blocks=prefix_blocks)
    got = driver.run()["b"]
    assert got == family.reference(second_text, [image], 8)
    assert driver.tokens_computed["b"] == len(ids_b) - prefix_blocks * block + len(got) - 1
    assert runner.num_encoder_calls == calls  # the prefix hit needed no encoder run
