"""Greedy parity for video items over a real ``mmis engine`` process (Qwen2-VL families).

A short synthetic clip (8 frames of 64x64: 4 temporal patches, 64 placeholder tokens) goes
through the model's own processor; the engine's tokens must be those of plain transformers
``generate(do_sample=False)`` for one video, a video and an image in one prompt, and the same
requests split across prefill chunks (``--max-num-batched-tokens`` smaller than the video's
span). Qwen2.5-VL spaces a video's temporal positions by ``tokens_per_second *
second_per_grid_ts``: a clip sampled at 1 fps (interval 4) checks that the spacing reaches the
positions. A resend is served from the prefix cache with the same tokens.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_harness import EngineHarness
from engine_inputs import ModelKit, image, kit_for, renamed
from video_inputs import Clip, clip, video_reference, video_request

pytestmark = [pytest.mark.model, pytest.mark.slow]

STEP = 24  # tokens per engine step: smaller than the video's 64 placeholder tokens
# (family, mode): whole videos on Qwen2-VL, split across chunks on both families (a split
# request takes every step of the whole one's path, and Qwen2.5-VL's temporal spacing must
# reach the positions of each chunk)
CASES = (("qwen2-vl", "whole"), ("qwen2-vl", "split"), ("qwen2.5-vl", "split"))


def specs() -> list[tuple[str, list[Clip], list[object]]]:
    return [
        ("What happens in the video?", [clip(700)], []),
        ("Does the picture appear in the video?", [clip(701)], [image(702)]),
        ("Describe the slow clip.", [clip(703, num_frames=6, fps=1.0)], []),
    ]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{m}" for f, m in CASES])
def case(request: pytest.FixtureRequest) -> tuple[str, str]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def kit(case: tuple[str, str], tiny_dirs: dict[str, Path]) -> ModelKit:
    return kit_for(case[0], tiny_dirs[case[0]])


@pytest.fixture(scope="module")
def engine(case: tuple[str, str], kit: ModelKit) -> Iterator[EngineHarness]:
    args = ("--max-num-batched-tokens", str(STEP)) if case[1] == "split" else ()
    with EngineHarness(kit.path, *args) as eng:
        eng.split = case[1] == "split"  # type: ignore[attr-defined]
        yield eng


def test_video_matches_generate_and_hits_the_prefix_cache(
    kit: ModelKit, engine: EngineHarness
) -> None:
    for text, videos, images in specs():
        request = video_request(kit, text, videos, images, max_tokens=8)  # type: ignore[arg-type]
        kinds = [f.modality for f in request.mm_features]
        assert kinds == ["video"] + ["image"] * len(images), kinds
        span = request.mm_features[0].placeholder.length
        if engine.split:  # type: ignore[attr-defined]
            assert span > STEP, span  # the video is split across chunks
        [res] = engine.run(request)
        assert res.error is None, res.error
        expected = video_reference(kit, text, videos, images, 8)  # type: ignore[arg-type]
        assert res.token_ids == expected, (kit.family, text)
        [again] = engine.run(renamed(request))
        assert again.error is None, again.error
        assert again.token_ids == res.token_ids
        assert again.num_cached_tokens > 0
