"""Greedy parity of a real ``mmis engine`` process with plain transformers ``generate()``.

Every request goes over the engine's real ZMQ sockets; "identical" means the same token ids
as ``generate(do_sample=False)`` on the same prompt and images, for every tiny family
(``tiny_model.FAMILIES``): single requests, 16 concurrent mixed requests joining while others
decode, a prefix-cache hit, ``n = 3``, and S7 (a prefix hit over an item sent through the
shared-memory store). The references of the single and concurrent requests are computed while
the engine process starts (``engine_references.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_harness import EngineHarness
from engine_inputs import (
    ModelKit,
    hash_only,
    image,
    kit_for,
    placeholder_end,
    renamed,
    with_data,
)
from engine_references import References, Spec

from mmis.protocol.messages import PoolingParams
from mmis.shm import ShmWriter

pytestmark = [pytest.mark.model, pytest.mark.slow]

FAMILIES = ("llava", "qwen2-vl", "qwen2.5-vl", "llava-siglip")
TEXTS = [
    "Hello, how are you today?",
    "Describe this image in one short sentence, please.",
    "What is in the picture? A red square, a blue circle and a green line.",
    "A cat sits on a warm mat near the window while it rains outside.",
    "The quick brown fox jumps over the lazy dog.",
]
LONG_TEXT = " ".join(TEXTS[1:4])  # enough tokens for full prefix blocks after the image


def single_specs() -> list[Spec]:
    """Zero, one and two images."""
    return [
        (TEXTS[i], [image(100 + 10 * i + j) for j in range(num_images)], 10)
        for i, num_images in enumerate((0, 1, 2))
    ]


def concurrent_specs() -> list[Spec]:
    """16 requests of 0-3 images (some shared); the first 8 decode longer."""
    specs: list[Spec] = []
    for i in range(16):
        images = [image(200 + (i + j) % 7) for j in range(i % 4)]
        max_tokens = 32 + i % 3 * 8 if i < 8 else 3 + i % 5 * 3
        specs.append((TEXTS[i % len(TEXTS)], images, max_tokens))
    return specs


@pytest.fixture(scope="module", params=FAMILIES)
def kit(request: pytest.FixtureRequest, tiny_dirs: dict[str, Path]) -> ModelKit:
    return kit_for(request.param, tiny_dirs[request.param])


@pytest.fixture(scope="module")
def shm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shm")


@pytest.fixture(scope="module")
def refs(kit: ModelKit) -> Iterator[References]:
    with References(kit, [*single_specs(), *concurrent_specs()]) as references:
        yield references


@pytest.fixture(scope="module")
def engine(kit: ModelKit, shm_dir: Path, refs: References) -> Iterator[EngineHarness]:
    # refs first: its worker computes the references while the engine process starts
    # client 1, not the default 0: every output must reach its own client's topic
    with EngineHarness(kit.path, "--shm-dir", str(shm_dir), client_index=1) as eng:
        yield eng


def test_single_requests_match_generate(
    kit: ModelKit, engine: EngineHarness, refs: References
) -> None:
    for text, images, max_tokens in single_specs():
        [res] = engine.run(kit.request(text, images, max_tokens=max_tokens))
        assert res.error is None, res.error
        assert res.finish_reason == {0: "length"}
        assert res.token_ids == refs(text, images, max_tokens), (kit.family, len(images))


def test_concurrent_mixed_requests_match_generate(
    kit: ModelKit, engine: EngineHarness, refs: References
) -> None:
    specs = concurrent_specs()
    requests = [kit.request(t, imgs, max_tokens=m) for t, imgs, m in specs]
    first, second = requests[:8], requests[8:]
    engine.send(*first)

    def decoding() -> bool:  # a first-wave request has tokens and is still running
        return any(
            engine.results[r.request_id].token_ids and not engine.results[r.request_id].done
            for r in first
        )

    engine.wait_until(decoding)
    engine.send(*second)
    results = engine.collect(r.request_id for r in requests)
    for req, (text, images, max_tokens) in zip(requests, specs, strict=True):
        res = results[req.request_id]
        assert res.error is None, res.error
        assert res.token_ids == refs(text, images, max_tokens), (kit.family, text)
    # continuous batching really happened: one step advanced both waves together
    first_ids = {r.request_id for r in first}
    second_ids = {r.request_id for r in second}
    mixed = [
        b
        for b in engine.batches
        if {o.request_id for o in b.outputs if o.new_token_ids} & first_ids
        and {o.request_id for o in b.outputs if o.new_token_ids} & second_ids
    ]
    assert mixed, "no step decoded a first-wave and a second-wave request together"


def test_repeated_prompt_and_image_hits_the_prefix_cache(
    kit: ModelKit, engine: EngineHarness, refs: References
) -> None:
    images = [image(300)]
    expected = refs(LONG_TEXT, images, 8)
    base = kit.request(LONG_TEXT, images, max_tokens=8)
    before = engine.call("stats")
    [first] = engine.run(base)
    [shadow_hit] = engine.run(hash_only(base))  # P0 believes P1 holds the image
    [resent] = engine.run(renamed(base))  # same prompt and image, data attached again
    assert first.num_cached_tokens == 0
    for res in (first, shadow_hit, resent):
        assert res.error is None, res.error
        assert res.token_ids == expected
    for res in (shadow_hit, resent):  # the hit covers the image's placeholder span
        assert res.num_cached_tokens >= placeholder_end(base)
    after = engine.call("stats")
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] >= 2 * placeholder_end(base)


def test_n_is_p0s_the_engine_refuses_n_three_and_runs_three_single_choices(
    kit: ModelKit, engine: EngineHarness, refs: References
) -> None:
    """P0 owns the choices (``serving_generate.py``: one request per choice, seed + i); the
    engine refuses ``n != 1`` with a typed error and runs the siblings P0 sends."""
    images = [image(400)]
    [refused] = engine.run(kit.request(TEXTS[1], images, max_tokens=6, n=3))
    assert refused.error is not None and refused.error.code == "invalid_request"
    assert "one request per choice" in refused.error.message
    assert refused.finish_reason == {0: "error"} and refused.token_ids == []
    siblings = [kit.request(TEXTS[1], images, max_tokens=6) for _ in range(3)]
    results = engine.run(*siblings)
    expected = refs(TEXTS[1], images, 6)
    for res in results:
        assert res.error is None, res.error
        assert res.finish_reason == {0: "length"}
        assert res.tokens == {0: expected}
    assert not [rid for rid in engine.results if "#" in rid]  # no engine-made child ids


def test_prefix_hit_over_shm_item_acknowledges_every_descriptor(
    kit: ModelKit, engine: EngineHarness, shm_dir: Path, refs: References
) -> None:
    """S7: the second request's payload is stripped by the prefix hit, yet its descriptor
    reaches the receiver, so the writer sees every descriptor acked and reclaims the space."""
    images = [image(500)]
    base = kit.request(LONG_TEXT, images, max_tokens=6)
    expected = refs(LONG_TEXT, images, 6)
    with ShmWriter(8 << 20, directory=shm_dir) as writer:
        address = base.mm_features[0].data
        assert isinstance(address, dict)
        put = writer.put(address)
        [first] = engine.run(with_data(base, [put]))
        [second] = engine.run(with_data(base, [writer.share(put)]))
        for res in (first, second):
            assert res.error is None, res.error
            assert res.token_ids == expected
        assert second.num_cached_tokens >= placeholder_end(base)
        stats = writer.stats()
        assert stats.outstanding_descriptors == 0, stats
        writer.reclaim()
        stats = writer.stats()
        assert (stats.used, stats.live_handles, stats.reclaimed_handles) == (0, 0, 1), stats


def test_mean_pooling_matches_transformers_and_never_takes_a_prefix_hit(
    kit: ModelKit, engine: EngineHarness, refs: References
) -> None:
    images = [image(600)]
    base = kit.request(LONG_TEXT, images)
    pooling = msgspec.structs.replace(
        base, sampling_params=None, pooling_params=PoolingParams("mean", normalize=True)
    )
    expected = refs.embedding(LONG_TEXT, images)
    [warm] = engine.run(renamed(base))  # leaves the prompt's blocks in the prefix cache
    results = engine.run(renamed(pooling), renamed(pooling))
    assert warm.error is None
    for res in results:
        assert res.error is None, res.error
        assert res.finish_reason == {0: "stop"} and res.num_cached_tokens == 0
        np.testing.assert_allclose(res.pooled[0], expected, rtol=1e-4, atol=1e-5)
