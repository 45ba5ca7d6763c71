"""Gemma 3 over a real ``mmis engine`` process: greedy parity with transformers ``generate()``.

The tiny Gemma 3 (``tiny_models/tiny_gemma3.py``) has two sliding-window layers (window 32) before
a full-attention layer, and 16 soft tokens per image that attend to each other in both
directions. The engine runs with 20-token steps and a 24-block KV pool, so long prompts cross
the window and several chunks (a chunk stops before an image rather than inside it: the
image's tokens need each other), concurrent requests are preempted, and a prefix hit may end
inside an image. Every answer must be the token ids of ``generate(do_sample=False)`` on the
processor's full output (``token_type_ids`` included, so transformers applies the image's
bidirectional mask).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_harness import EngineHarness
from engine_inputs import ModelKit, image, renamed
from engine_references import References, Spec

from mmis.tiny_models.tiny_gemma3 import SOFT_TOKENS, WINDOW
from mmis.tiny_models.tiny_model import build_tiny_model

pytestmark = [pytest.mark.model, pytest.mark.slow]

STEP = 20  # tokens per step: more than one image (16), less than most prompts
NUM_BLOCKS = 24  # 23 usable blocks of 16 tokens
LONG = (
    "The quick brown fox jumps over the lazy dog. A cat sits on a warm mat near the window "
    "while it rains outside. What is in the picture? A red square, a blue circle and a green "
    "line. Describe this image in one short sentence, please."
)
TEXTS = [
    "Describe this image in one short sentence, please.",
    "What is in the picture? A red square, a blue circle and a green line.",
    "A cat sits on a warm mat near the window while it rains outside.",
    "Hello, how are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
]


def single_specs() -> list[Spec]:
    return [
        (TEXTS[3], [], 12),
        (TEXTS[0], [image(11)], 12),
        (LONG, [image(12), image(13)], 16),  # two images, past the window, several chunks
        (LONG, [image(14), image(15), image(16)], 8),
    ]


def concurrent_specs() -> list[Spec]:
    return [(text, [image(20 + i)], 24) for i, text in enumerate(TEXTS)]


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory) -> ModelKit:
    return ModelKit.load("gemma3", build_tiny_model(tmp_path_factory.mktemp("m") / "g", "gemma3"))


@pytest.fixture(scope="module")
def refs(kit: ModelKit) -> Iterator[References]:
    with References(kit, [*single_specs(), *concurrent_specs()]) as references:
        yield references


@pytest.fixture(scope="module")
def engine(kit: ModelKit, refs: References) -> Iterator[EngineHarness]:
    args = ["--max-num-batched-tokens", str(STEP), "--num-kv-blocks", str(NUM_BLOCKS)]
    with EngineHarness(kit.path, *args) as eng:
        yield eng


def test_the_tiny_model_has_what_the_tests_rely_on(kit: ModelKit) -> None:
    text = kit.hf_model.config.get_text_config()
    assert "sliding_attention" in text.layer_types and text.sliding_window == WINDOW
    request = kit.request(LONG, [image(12), image(13)])
    assert [f.placeholder.length for f in request.mm_features] == [SOFT_TOKENS] * 2
    assert len(request.prompt_token_ids) > 2 * WINDOW
    # the bidirectional image mask changes the answer: a parity pass is not a causal accident
    inputs = kit.inputs(LONG, [image(12), image(13)])
    with torch.inference_mode():
        causal = kit.hf_model.generate(
            input_ids=inputs["input_ids"],
            pixel_values=inputs["pixel_values"],
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=[],
        )[0, inputs["input_ids"].shape[1] :].tolist()
    assert causal != kit.reference(LONG, [image(12), image(13)], 32)


def test_single_requests_match_generate(
    kit: ModelKit, engine: EngineHarness, refs: References
) -> None:
    for text, images, max_tokens in single_specs():
        request = kit.request(text, images, max_tokens=max_tokens)
        [res] = engine.run(request)
        assert res.error is None, res.error
        assert res.token_ids == refs(text, images, max_tokens), (len(images), text[:20])
        [again] = engine.run(renamed(request))
        assert again.error is None, again.error
        assert again.token_ids == res.token_ids
        if len(request.prompt_token_ids) > 32:
            assert again.num_cached_tokens > 0


def test_a_prefix_hit_that_ends_inside_an_image_matches_generate(
    kit: ModelKit, engine: EngineHarness, refs: References
) -> None:
    """Same image, different text after it: the hit covers block 0 and stops in the image."""
    images = [image(30)]
    first = kit.request(TEXTS[0], images, max_tokens=6)
    span = first.mm_features[0].placeholder
    assert span.offset < 16 < span.offset + span.length  # block 0 ends inside the image
    [res] = engine.run(first)
    assert res.error is None, res.error
    second = kit.request(TEXTS[1], images, max_tokens=6)
    [hit] = engine.run(second)
    assert hit.error is None, hit.error
    assert hit.num_cached_tokens == 16
    assert hit.token_ids == refs(TEXTS[1], images, 6)


def test_concurrent_requests_are_preempted_and_still_match(
    kit: ModelKit, engine: EngineHarness, refs: References
) -> None:
    before = engine.call("stats")
    specs = concurrent_specs()
    requests = [kit.request(t, imgs, max_tokens=m) for t, imgs, m in specs]
    assert sum(len(r.prompt_token_ids) + 24 for r in requests) > (NUM_BLOCKS - 1) * 16
    results = engine.run(*requests)
    for res, (text, images, max_tokens) in zip(results, specs, strict=True):
        assert res.error is None, res.error
        assert res.token_ids == refs(text, images, max_tokens), text
    assert engine.call("stats")["num_preemptions"] > before["num_preemptions"]


def test_an_image_larger_than_a_step_is_refused_naming_the_flag(
    kit: ModelKit, tmp_path: Path
) -> None:
    with EngineHarness(kit.path, "--max-num-batched-tokens", str(SOFT_TOKENS - 1)) as small:
        [res] = small.run(kit.request(TEXTS[0], [image(40)], max_tokens=4))
        [text_only] = small.run(kit.request(TEXTS[3], max_tokens=4))
    assert res.error is not None and res.error.code == "invalid_request"
    assert "--max-num-batched-tokens" in res.error.message
    assert text_only.error is None and len(text_only.token_ids) == 4
