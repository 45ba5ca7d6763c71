"""Scheduler: chunked prefill around images and the per-step encoder budget.

An image is encoded only when the chunk reaches its placeholder range and its range is never
split across chunks (unless its encoder output is already cached); the encoder compute budget
defers further images to the next step.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sched_harness import IMG, Engine, image, make, reference, text


def test_an_image_is_encoded_only_when_its_range_is_reached_and_never_split():
    prompt = [*text(1, 10), *[IMG] * 16, *text(2, 14)]  # image at [10, 26)
    eng = Engine(block_size=4, num_blocks=64, max_num_batched_tokens=20)
    eng.add(make("img", prompt, image("pic", 10, 16), max_tokens=2))
    chunks = []
    while eng.sched.has_unfinished_requests():
        out, _ = eng.step()
        for item in out.scheduled:
            encoded = [item.mm_items[i].mm_hash for i in item.encoder_inputs]
            chunks.append((item.start_position, len(item.token_ids), encoded))
    # [0, 20) would split the image: stop before it; then the whole image in one chunk
    assert chunks[:3] == [(0, 10, []), (10, 20, ["pic"]), (30, 10, [])]
    assert eng.runner.encoded == [(2, "pic")]
    assert eng.outputs["img"] == reference(prompt, [image("pic", 10, 16)], 2)


def test_a_cached_encoder_output_may_be_split_across_chunks():
    eng = Engine(block_size=4, num_blocks=64, max_num_batched_tokens=20)
    first = [*text(1, 10), *[IMG] * 16, 5]
    eng.add(make("first", first, image("pic", 10, 16), max_tokens=1))
    eng.run()
    second = [*text(3, 10), *[IMG] * 16, 6]  # other text: no prefix hit, same image
    eng.add(make("second", second, image("pic", 10, 16), max_tokens=1))
    out, _ = eng.step()
    (item,) = out.scheduled
    assert (item.start_position, len(item.token_ids), item.encoder_inputs) == (0, 20, [])
    eng.run()
    assert eng.runner.encoded == [(2, "pic")]  # by "first" only: reused from the cache
    assert eng.outputs["second"] == reference(second, [image("pic", 10, 16)], 1)


def test_the_encoder_budget_defers_images_to_the_next_step():
    eng = Engine(block_size=4, num_blocks=64, encoder_compute_budget=8)
    eng.add(make("a", [1, *[IMG] * 8, 2], image("a", 1, 8), max_tokens=1))
    eng.add(make("b", [3, *[IMG] * 8, 4], image("b", 1, 8), max_tokens=1))
    out, _ = eng.step()
    assert [(s.request_id, s.start_position, len(s.token_ids)) for s in out.scheduled] == [
        ("a", 0, 10),
        ("b", 0, 1),  # b stops before its image: the step's encoder budget is spent
    ]
    eng.run()
    assert eng.runner.encoded == [(1, "a"), (2, "b")]
    assert eng.outputs["b"] == reference([3, *[IMG] * 8, 4], [image("b", 1, 8)], 1)
