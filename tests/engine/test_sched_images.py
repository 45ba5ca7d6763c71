"""Scheduler: chunked prefill around images and the per-step encoder budget.

An image is encoded (whole, into the encoder cache) by the first chunk that reaches its
placeholder range, and its range may then be split across chunks, so an image larger than
a step's token budget is served; an image larger than the encoder cache is refused naming
the flag that raises it; the encoder compute budget defers further images to the next step.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sched_harness import IMG, Engine, image, make, reference, text


def _chunks(eng: Engine) -> list[tuple[int, int, list[str]]]:
    chunks = []
    while eng.sched.has_unfinished_requests():
        out, _ = eng.step()
        for item in out.scheduled:
            encoded = [item.mm_items[i].mm_hash for i in item.encoder_inputs]
            chunks.append((item.start_position, len(item.token_ids), encoded))
    return chunks


def test_an_image_is_encoded_by_the_first_chunk_reaching_it_and_may_be_split():
    prompt = [*text(1, 10), *[IMG] * 16, *text(2, 14)]  # image at [10, 26)
    eng = Engine(block_size=4, num_blocks=64, max_num_batched_tokens=20)
    eng.add(make("img", prompt, image("pic", 10, 16), max_tokens=2))
    # [0, 20) reaches the image: it is encoded there, and its range continues in [20, 40)
    assert _chunks(eng)[:2] == [(0, 20, ["pic"]), (20, 20, [])]
    assert eng.runner.encoded == [(1, "pic")]
    assert eng.outputs["img"] == reference(prompt, [image("pic", 10, 16)], 2)


def test_an_image_larger_than_a_step_is_served_across_chunks():
    prompt = [*text(1, 3), *[IMG] * 20, 7]  # image at [3, 23): 20 tokens, 8 per step
    eng = Engine(block_size=4, num_blocks=64, max_num_batched_tokens=8)
    eng.add(make("big", prompt, image("big", 3, 20), max_tokens=2))
    assert _chunks(eng)[:3] == [(0, 8, ["big"]), (8, 8, []), (16, 8, [])]
    assert eng.runner.encoded == [(1, "big")]  # once, in the first chunk
    assert eng.outputs["big"] == reference(prompt, [image("big", 3, 20)], 2)
    eng.assert_pool_empty()


def test_an_image_larger_than_the_encoder_cache_is_refused_naming_the_flag():
    eng = Engine(block_size=4, num_blocks=64, encoder_cache_size=8, encoder_compute_budget=8)
    eng.add(make("huge", [1, *[IMG] * 12, 2], image("huge", 1, 12)))
    eng.add(make("ok", [3, *[IMG] * 8, 4], image("ok", 1, 8), max_tokens=1))
    eng.run()
    error = eng.finished["huge"].error
    assert error is not None and not error.retryable
    assert "needs 12 placeholder tokens" in error.message
    assert "--encoder-cache-tokens" in error.message
    assert eng.outputs["ok"] == reference([3, *[IMG] * 8, 4], [image("ok", 1, 8)], 1)


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
    assert eng.runner.encoded == [(1, "pic")]  # by "first" only: reused from the cache
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


def test_with_whole_spans_a_chunk_stops_before_an_image_instead_of_inside_it():
    """Gemma 3's image tokens attend to each other: a chunk may not end inside one."""
    prompt = [*text(1, 10), *[IMG] * 16, *text(2, 14)]  # image at [10, 26)
    eng = Engine(block_size=4, num_blocks=64, max_num_batched_tokens=20, whole_mm_spans=True)
    eng.add(make("img", prompt, image("pic", 10, 16), max_tokens=2))
    # [0, 20) would end inside the image: it stops at 10; the image goes whole in [10, 30)
    assert _chunks(eng)[:2] == [(0, 10, []), (10, 20, ["pic"])]
    assert eng.outputs["img"] == reference(prompt, [image("pic", 10, 16)], 2)


def test_with_whole_spans_an_image_larger_than_a_step_is_refused_naming_the_flag():
    eng = Engine(block_size=4, num_blocks=64, max_num_batched_tokens=8, whole_mm_spans=True)
    prompt = [*text(1, 3), *[IMG] * 12, 7]
    eng.add(make("big", prompt, image("big", 3, 12)), make("ok", text(3, 5)))
    eng.run()
    assert eng.finished["big"].error is not None
    assert "--max-num-batched-tokens" in eng.finished["big"].error.message
    assert eng.finished["ok"].error is None
