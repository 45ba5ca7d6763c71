"""LLaVA-NeXT and LLaVA-OneVision (any-resolution tiles): greedy parity over a real engine.

Images of different sizes and aspect ratios take different tile grids, so their placeholder
counts differ (LLaVA-NeXT 42..88, OneVision 66..196 in the tiny models). In process, the
adapter's counts and encoder rows must be those of the processor and of transformers'
``get_image_features`` (OneVision's multi-image mode included); bad tensors are typed errors.
Over one real ``mmis engine`` process per family, with ``--max-num-batched-tokens`` smaller
than every image (each image spread over several prefill chunks) and a KV pool that holds the
largest request but not all of them at once, the tokens must be those of plain transformers
``generate(do_sample=False)``: several images in one long prompt, the same request again from
the prefix cache, and concurrent requests that are preempted. The references are computed
while the engine process starts (``engine_references.py``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_harness import EngineHarness
from engine_inputs import ModelKit, image, kit_for, renamed
from engine_references import References, Spec

from mmis.engine.execution.encoder_sizing import largest_item_tokens, load_image_processor
from mmis.engine.execution.model import ModelAdapter, ModelInputError, load_adapter
from mmis.tiny_models.tiny_model import FINGERPRINT_FILE, build_tiny_model, fingerprint

pytestmark = [pytest.mark.model, pytest.mark.slow]

FAMILIES = ("llava-next", "llava-onevision")
STEP = 12  # tokens per engine step: smaller than every image
BLOCK = 16
# (height, width): wide, tall, square and a thin strip take different grids
SIZES = [(40, 70), (130, 96), (64, 64), (20, 200), (96, 116), (200, 20)]
LONG = (
    "Compare the three pictures one by one, then say which one is the brightest, which one "
    "is the darkest and what the quick brown fox would think of each of them."
)
TEXTS = [
    "Describe this image in one short sentence, please.",
    "What is in the picture? A red square, a blue circle and a green line.",
    "A cat sits on a warm mat near the window while it rains outside.",
    "Hello, how are you today?",
    "The model answers questions about images and text.",
]


def long_spec() -> Spec:
    return LONG, [image(700), image(701, SIZES[1]), image(702, SIZES[3])], 10


def preempt_specs() -> list[Spec]:
    return [(t, [image(710 + i, SIZES[i])], 40) for i, t in enumerate(TEXTS)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-anyres")
    return {family: build_tiny_model(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="module", params=FAMILIES)
def kit(request: pytest.FixtureRequest, model_dirs: dict[str, Path]) -> ModelKit:
    return kit_for(request.param, model_dirs[request.param])


@pytest.fixture(scope="module")
def adapter(kit: ModelKit) -> ModelAdapter:
    return load_adapter(kit.path, "cpu", torch.float32)


@pytest.fixture(scope="module")
def refs(kit: ModelKit) -> Iterator[References]:
    with References(kit, [long_spec(), *preempt_specs()]) as references:
        yield references


def pool_blocks(kit: ModelKit) -> int:
    """KV blocks (the null block included) for the largest request alone, not all at once."""
    specs = [long_spec(), *preempt_specs()]
    sizes = [len(kit.request(t, ims).prompt_token_ids) + m for t, ims, m in specs]
    return math.ceil(max(sizes) / BLOCK) + 2


@pytest.fixture(scope="module")
def engine(kit: ModelKit, refs: References) -> Iterator[EngineHarness]:
    # refs first: its worker computes the references while the engine process starts
    args = ["--max-num-batched-tokens", str(STEP), "--block-size", str(BLOCK)]
    args += ["--num-kv-blocks", str(pool_blocks(kit))]
    with EngineHarness(kit.path, *args) as eng:
        yield eng


def test_the_tiny_models_are_built_fingerprinted_and_small(model_dirs: dict[str, Path]) -> None:
    from transformers import AutoConfig

    for family, path in model_dirs.items():
        assert (path / FINGERPRINT_FILE).read_text().strip() == fingerprint(family)
        assert (path / "model.safetensors").stat().st_size < 4 * 2**20
        config = AutoConfig.from_pretrained(path)
        assert config.model_type == family.replace("-", "_")
        assert len(config.image_grid_pinpoints) > 1


def test_counts_and_rows_are_those_of_the_processor_and_transformers(
    kit: ModelKit, adapter: ModelAdapter
) -> None:
    images = [image(600 + i, size) for i, size in enumerate(SIZES)]
    request = kit.request("Hi", images)
    items = [f.data for f in request.mm_features]
    inputs = kit.inputs("Hi", images)
    split = adapter.split_processor_output(dict(inputs))
    assert [s["pixel_values"].shape for s in split] == [i["pixel_values"].shape for i in items]
    lengths = [f.placeholder.length for f in request.mm_features]
    assert [adapter.num_placeholder_tokens(item) for item in items] == lengths
    assert len(set(lengths)) >= 5, lengths  # the sizes take different grids
    keys = ("pixel_values", "image_sizes", "batch_num_images")
    with torch.inference_mode():
        expected = kit.hf_model.model.get_image_features(
            **{k: inputs[k] for k in keys if k in inputs}, return_dict=True
        ).pooler_output
        rows = adapter.encode_images(items)
    for got, want in zip(rows, expected, strict=True):
        assert got.shape == want.shape and torch.equal(got, want)
    bad = dict(kit.request("Hi", [image(620, SIZES[1])]).mm_features[0].data)
    with pytest.raises(ModelInputError, match=r"needs \d+ tiles"):
        adapter.encode_images([{**bad, "pixel_values": bad["pixel_values"][:, :2]}])
    with pytest.raises(ModelInputError, match="image_sizes"):
        adapter.num_placeholder_tokens({**bad, "image_sizes": np.array([[0, 5]])})
    with pytest.raises(ModelInputError, match="floating point"):
        adapter.encode_images([{**bad, "pixel_values": bad["pixel_values"].astype(np.int64)}])


def test_the_encoder_cache_is_sized_for_the_largest_grid_item(
    kit: ModelKit, adapter: ModelAdapter
) -> None:
    """The largest item is no square for OneVision (``anyres_max_9`` shrinks big grids): the
    sizing sweeps every grid, so each image the processor can give fits."""
    largest = largest_item_tokens(adapter, load_image_processor(str(kit.path), None))
    sizes = [*SIZES, (1000, 1210), (1000, 1000), (190, 190)]
    counts = {
        size: kit.request("Hi", [image(640, size)]).mm_features[0].placeholder.length
        for size in sizes
    }
    assert largest is not None and largest >= max(counts.values()), (largest, counts)
    if kit.family == "llava-onevision":
        assert counts[(96, 116)] > counts[(1000, 1000)]  # an oblong grid beats the square
    else:
        assert largest == counts[(1000, 1000)]  # LLaVA-NeXT's largest is its square grid


def test_onevision_multi_image_prompts_take_one_tile_per_image(
    model_dirs: dict[str, Path],
) -> None:
    """A prompt of several images (a nested images list) takes OneVision's multi-image mode."""
    kit = kit_for("llava-onevision", model_dirs["llava-onevision"])
    adapter = load_adapter(kit.path, "cpu", torch.float32)
    images = [image(630, SIZES[0]), image(631, SIZES[1])]
    prompt = "USER: <image>\n<image>\nHi\nASSISTANT:"
    inputs = kit.processor(text=[prompt], images=[images], return_tensors="pt")
    items = adapter.split_processor_output(dict(inputs))
    assert [item["pixel_values"].shape[1] for item in items] == [1, 1]
    ids = inputs["input_ids"][0]
    assert sum(adapter.num_placeholder_tokens(it) for it in items) == int(
        (ids == kit.image_token_id).sum()
    )
    with torch.inference_mode():
        expected = kit.hf_model.model.get_image_features(
            pixel_values=inputs["pixel_values"],
            image_sizes=inputs["image_sizes"],
            batch_num_images=inputs["batch_num_images"],
            return_dict=True,
        ).pooler_output
        together = adapter.encode_images(items)
        alone = adapter.encode_images(items[1:])  # a lone multi-image item
    assert all(torch.equal(a, b) for a, b in zip(together, expected, strict=True))
    torch.testing.assert_close(alone[0], expected[1])


def test_tiles_split_across_chunks_match_generate(
    kit: ModelKit, engine: EngineHarness, refs: References
) -> None:
    text, images, max_tokens = long_spec()
    request = kit.request(text, images, max_tokens=max_tokens)
    spans = [f.placeholder.length for f in request.mm_features]
    assert all(length > STEP for length in spans) and len(set(spans)) == 3, spans
    assert len(request.prompt_token_ids) > 4 * STEP  # several prefill chunks
    [res] = engine.run(request)
    assert res.error is None, res.error
    assert res.token_ids == refs(text, images, max_tokens), kit.family
    [again] = engine.run(renamed(request))  # from the prefix cache this time
    assert again.error is None, again.error
    assert again.token_ids == res.token_ids
    assert again.num_cached_tokens > 0


def test_preempted_requests_still_match_generate(
    kit: ModelKit, engine: EngineHarness, refs: References
) -> None:
    before = engine.call("stats")
    specs = preempt_specs()
    requests = [kit.request(t, ims, max_tokens=m) for t, ims, m in specs]
    needed = sum(len(r.prompt_token_ids) + m for r, (_, _, m) in zip(requests, specs, strict=True))
    assert needed > before["num_kv_blocks"] * BLOCK  # they cannot all hold their KV at once
    results = engine.run(*requests)
    for res, (text, images, max_tokens) in zip(results, specs, strict=True):
        assert res.error is None, res.error
        assert res.token_ids == refs(text, images, max_tokens), (kit.family, text)
    after = engine.call("stats")
    assert after["num_preemptions"] > before["num_preemptions"]
