"""Greedy parity with images split across prefill chunks, over a real ``mmis engine`` process.

With ``--max-num-batched-tokens 6`` every image (16 placeholder tokens in every tiny family)
is larger than one step: its encoder output is computed by the first chunk that reaches it
and its range is spread over several chunks (``engine/scheduling/scheduler.py``). The tokens must be
those of plain transformers ``generate(do_sample=False)``, with two images in one prompt, a
long prompt crossing many chunks, the same request again served from the prefix cache, and
drift (S1) on a split image healing to the same tokens. The references are computed while the
engine process starts (``engine_references.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_harness import EngineHarness
from engine_inputs import ModelKit, hash_only, image, kit_for, renamed
from engine_references import References, Spec

pytestmark = [pytest.mark.model, pytest.mark.slow]

# LLaVA (encoder output rows sliced per chunk) and Qwen2-VL (the same, with M-RoPE positions);
# Qwen2.5-VL and LLaVA-SigLIP differ from these in the tower alone, whose whole output the
# split path slices alike (16 placeholder tokens in each): their parity is test_engine_parity's
FAMILIES = ("llava", "qwen2-vl")
STEP = 6  # tokens per engine step: smaller than every image
DRIFT_TEXT = "What is in the picture?"


def split_specs() -> list[Spec]:
    """One image, then two images in one prompt."""
    return [
        ("Describe the picture.", [image(500)], 8),
        (
            "Compare these two pictures, then say which one is brighter.",
            [image(501), image(502)],
            8,
        ),
    ]


@pytest.fixture(scope="module", params=FAMILIES)
def kit(request: pytest.FixtureRequest, tiny_dirs: dict[str, Path]) -> ModelKit:
    return kit_for(request.param, tiny_dirs[request.param])


@pytest.fixture(scope="module")
def refs(kit: ModelKit) -> Iterator[References]:
    with References(kit, [*split_specs(), (DRIFT_TEXT, [image(510)], 6)]) as references:
        yield references


@pytest.fixture(scope="module")
def engine(kit: ModelKit, refs: References) -> Iterator[EngineHarness]:
    # refs first: its worker computes the references while the engine process starts
    with EngineHarness(kit.path, "--max-num-batched-tokens", str(STEP)) as eng:
        yield eng


def test_images_split_across_chunks_match_generate(
    kit: ModelKit, engine: EngineHarness, refs: References
) -> None:
    for text, images, max_tokens in split_specs():
        request = kit.request(text, images, max_tokens=max_tokens)
        spans = [f.placeholder.length for f in request.mm_features]
        assert all(length > STEP for length in spans), spans  # every image is split
        [res] = engine.run(request)
        assert res.error is None, res.error
        assert res.token_ids == refs(text, images, max_tokens), (kit.family, text)
        [again] = engine.run(renamed(request))  # from the prefix cache this time
        assert again.error is None, again.error
        assert again.token_ids == res.token_ids
        assert again.num_cached_tokens > 0


def test_drift_on_a_split_image_heals_to_the_same_tokens(
    kit: ModelKit, engine: EngineHarness, refs: References
) -> None:
    """S1 with a split image: P1 dropped the item (the fault knob), a hash-only resend is
    one retryable miss, and the resend with data (split across chunks again) heals."""
    images = [image(510)]
    base = kit.request(DRIFT_TEXT, images, max_tokens=6)
    [first] = engine.run(base)
    assert first.error is None, first.error
    assert engine.call("set_fault_evict_rate", 1.0) == 1.0
    try:
        [missed] = engine.run(hash_only(base))
    finally:
        engine.call("set_fault_evict_rate", 0.0)
    assert missed.error is not None and missed.error.code == "multimodal_cache_miss"
    assert missed.error.retryable and missed.missing_mm_hashes == [base.mm_features[0].mm_hash]
    [healed] = engine.run(renamed(base))
    assert healed.error is None, healed.error
    assert healed.token_ids == first.token_ids == refs(DRIFT_TEXT, images, 6)
