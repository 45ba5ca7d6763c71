"""P1 takes an encoder output in place of an item's pixels (E/PD, issue 46), and refuses a bad one.

Unit: :func:`mmis.engine.encoder_inputs.check_embeds` names each reason (numpy arrays and torch
bfloat16 tensors alike). Through a real ``mmis engine`` over its real sockets (float32, tiny
LLaVA and tiny Qwen2-VL): an item whose data is the adapter's own encoder output (Qwen2-VL's
``image_grid_thw`` beside it, for M-RoPE) gives the pixel request's greedy tokens without a
run of P1's tower; a wrong-shape, wrong-dtype, NaN-filled or pixels-beside output is answered
as a receiver-cache miss naming that hash, is no longer held, is counted by reason (through
P0's stats path to the metric), and the same request with pixels then succeeds.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_harness import EngineHarness, Result
from engine_inputs import ModelKit, hash_only, image, kit_for, with_data

from mmis.engine.encoder_inputs import EmbedsSpec, check_embeds
from mmis.protocol.encoder import MM_EMBEDS, PIXEL_KEYS
from mmis.protocol.messages import EngineCoreRequest, MultiModalFeature, PlaceholderRange

TEXT = "Describe this image in one short sentence, please."
SPEC = EmbedsSpec("float32", 8)


# ------------------------------------------------------------------ the check, one piece
@pytest.mark.parametrize(
    ("data", "reason"),
    [
        ({MM_EMBEDS: np.zeros((4, 8), np.float32)}, None),
        ({MM_EMBEDS: np.zeros((4, 8), np.float32), "image_grid_thw": np.ones((1, 3))}, None),
        ({MM_EMBEDS: np.zeros((4, 8), np.float32), "pixel_values": np.zeros(3)}, "pixels"),
        ({MM_EMBEDS: np.zeros((4, 8), np.float16)}, "dtype"),
        ({MM_EMBEDS: torch.zeros(4, 8, dtype=torch.bfloat16)}, "dtype"),
        ({MM_EMBEDS: np.zeros((3, 8), np.float32)}, "shape"),
        ({MM_EMBEDS: np.zeros((4, 9), np.float32)}, "shape"),
        ({MM_EMBEDS: np.zeros((1, 4, 8), np.float32)}, "shape"),
        ({MM_EMBEDS: [[0.0] * 8] * 4}, "shape"),
        ({MM_EMBEDS: np.full((4, 8), np.nan, np.float32)}, "nonfinite"),
        ({MM_EMBEDS: np.full((4, 8), np.inf, np.float32)}, "nonfinite"),
    ],
)
def test_check_names_each_reason(data: dict[str, Any], reason: str | None) -> None:
    found = check_embeds(data, 4, SPEC, "h1")
    assert (None if found is None else found.reason) == reason
    if found is not None:
        assert found.message.startswith("item h1: ")


def test_check_takes_torch_bfloat16_for_a_bfloat16_engine() -> None:
    spec = EmbedsSpec("bfloat16", 8)
    good = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert check_embeds({MM_EMBEDS: good}, 4, spec) is None
    bad = good.clone()
    bad[2, 3] = float("nan")
    rejection = check_embeds({MM_EMBEDS: bad}, 4, spec)
    assert rejection is not None and rejection.reason == "nonfinite"
    rejection = check_embeds({MM_EMBEDS: np.zeros((4, 8), np.float32)}, 4, spec)
    assert rejection is not None and rejection.reason == "dtype"


# ------------------------------------------------------------------ through a real engine
@pytest.fixture(scope="module")
def kits(tiny_dirs: dict[str, Path]) -> dict[str, ModelKit]:
    return {f: kit_for(f, tiny_dirs[f]) for f in ("llava", "qwen2-vl")}


@pytest.fixture(scope="module")
def engines(kits: dict[str, ModelKit]) -> Iterator[dict[str, EngineHarness]]:
    llava = EngineHarness(kits["llava"].path, "--dtype", "float32")
    qwen = EngineHarness(kits["qwen2-vl"].path, "--dtype", "float32")
    try:
        llava.start()
        qwen.start()
        yield {"llava": llava, "qwen2-vl": qwen}
    finally:
        llava.close()
        qwen.close()


def encoder_output(kit: ModelKit, data: dict[str, Any]) -> np.ndarray:
    """The family's own encoder output for one item (what an ``mmis encoder`` would send)."""
    from mmis.engine.execution.model import load_adapter

    adapter = load_adapter(kit.path, "cpu", torch.float32)
    with torch.inference_mode():
        [rows] = adapter.encode_images([data])
    return np.ascontiguousarray(rows.numpy())


def as_embeds(request: EngineCoreRequest, embeds: Any, tag: str, **extra: Any) -> EngineCoreRequest:
    """The request's one item, renamed ``tag``, carrying ``embeds`` in place of its pixels."""
    [feature] = request.mm_features
    assert isinstance(feature.data, dict)
    data = {k: v for k, v in feature.data.items() if k not in PIXEL_KEYS}
    item = MultiModalFeature(
        modality="image",
        mm_hash=f"{tag}-{feature.mm_hash}",
        placeholder=feature.placeholder,
        data={**data, MM_EMBEDS: embeds, **extra},
    )
    return with_items(request, [item])


def with_items(request: EngineCoreRequest, items: list[MultiModalFeature]) -> EngineCoreRequest:
    """A copy (fresh id) with these items."""
    return with_data(msgspec.structs.replace(request, mm_features=items), [i.data for i in items])


def encoder_calls(engine: EngineHarness) -> int:
    return int(engine.call("stats")["encoder_calls"])


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("family", ["llava", "qwen2-vl"])
def test_encoder_output_gives_the_pixel_tokens_without_the_tower(
    family: str, kits: dict[str, ModelKit], engines: dict[str, EngineHarness]
) -> None:
    kit, engine = kits[family], engines[family]
    pixels = kit.request(TEXT, [image(4601)], max_tokens=8)
    [pixel_item] = pixels.mm_features
    assert isinstance(pixel_item.data, dict)
    embeds = encoder_output(kit, pixel_item.data)
    given = as_embeds(pixels, embeds, "embeds")
    if family == "qwen2-vl":  # the grid stays beside the output: M-RoPE positions need it
        assert "image_grid_thw" in given.mm_features[0].data  # type: ignore[operator]
    calls = encoder_calls(engine)
    [from_embeds] = engine.run(given)
    assert from_embeds.error is None, from_embeds.error
    assert encoder_calls(engine) == calls, "P1 ran its tower for an item that brought its output"
    [from_pixels] = engine.run(pixels)
    assert from_pixels.error is None and encoder_calls(engine) == calls + 1
    assert from_embeds.token_ids == from_pixels.token_ids == kit.reference(TEXT, [image(4601)], 8)


def assert_miss(res: Result, hashes: list[str]) -> None:
    assert res.error is not None, "expected a multimodal cache miss"
    assert res.error.code == "multimodal_cache_miss" and res.error.retryable is True
    assert res.missing_mm_hashes == hashes and res.token_ids == []


@pytest.mark.model
@pytest.mark.slow
def test_bad_encoder_outputs_are_a_miss_then_the_pixels_heal(
    kits: dict[str, ModelKit], engines: dict[str, EngineHarness]
) -> None:
    from mmis.frontend.client.stats_poller import receiver_figures
    from mmis.telemetry.stats_collector import EngineStatsCollector

    kit, engine = kits["llava"], engines["llava"]
    pixels = kit.request(TEXT, [image(4602)], max_tokens=4)
    [pixel_item] = pixels.mm_features
    assert isinstance(pixel_item.data, dict)
    good = encoder_output(kit, pixel_item.data)
    nan = good.copy()
    nan[3] = np.nan
    bad = {
        "shape": as_embeds(pixels, good[1:], "shape"),
        "dtype": as_embeds(pixels, torch.from_numpy(good).to(torch.bfloat16), "dtype"),
        "nonfinite": as_embeds(pixels, nan, "nan"),
        "pixels": as_embeds(pixels, good, "pix", pixel_values=pixel_item.data["pixel_values"]),
    }
    expected = kit.reference(TEXT, [image(4602)], 4)
    before = engine.call("receiver_stats")
    for reason, request in bad.items():
        mm_hash = request.mm_features[0].mm_hash
        [refused] = engine.run(request)
        assert_miss(refused, [mm_hash])
        [again] = engine.run(hash_only(request))  # not held: a later hit is not served it
        assert_miss(again, [mm_hash])
        evicted = {h for b in engine.batches for h in b.evicted_mm_hashes}
        assert mm_hash in evicted, f"{reason}: P0's shadow must learn it is gone"
        [healed] = engine.run(with_data(request, [pixel_item.data]))  # the retry's pixels
        assert healed.error is None and healed.token_ids == expected, reason
    after = engine.call("receiver_stats")
    for reason in bad:
        key = f"encoder_outputs_rejected_{reason}"
        assert after[key] - before[key] == 1, key
    # a bad output stored before another item's miss is refused too, in the same answer
    unknown = MultiModalFeature(
        modality="image", mm_hash="never-sent", placeholder=PlaceholderRange(0, 1), data=None
    )
    [stored] = as_embeds(pixels, good[1:], "both").mm_features
    [refused] = engine.run(with_items(pixels, [unknown, stored]))
    assert_miss(refused, ["never-sent", stored.mm_hash])
    [again] = engine.run(hash_only(with_items(pixels, [stored])))
    assert_miss(again, [stored.mm_hash])
    # the count reaches P0's /metrics through its stats path
    collector = EngineStatsCollector("m")
    collector.update({**engine.call("stats"), **receiver_figures(engine.call("receiver_stats"))})
    samples = {
        s.labels["reason"]: s.value
        for family in collector.collect()
        if family.name == "mmis_encoder_outputs_rejected"
        for s in family.samples
    }
    assert samples["shape"] == after["encoder_outputs_rejected_shape"] + 1
    assert samples["dtype"] >= 1 and samples["pixels"] >= 1 and samples["nonfinite"] >= 1
