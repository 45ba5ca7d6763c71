"""Bad input at the boundary of a real ``mmis engine``: typed error outputs, never a crash.

Every request below is answered with ONE ``finish_reason="error"`` output carrying a typed
code; malformed frames are dropped (there is no id to answer); a request whose tensors pass
admission but break the vision encoder fails only its own step. After each storm the engine
still gives tokens identical to ``generate()`` and holds no request or KV block.
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_harness import EngineHarness
from engine_inputs import ModelKit, image, kit_for, new_id, with_data

from mmis.protocol.messages import (
    EngineCoreRequest,
    MultiModalFeature,
    PlaceholderRange,
    PoolingParams,
    SamplingParams,
    ShmAddress,
)

pytestmark = [pytest.mark.model, pytest.mark.slow]

MAX_MODEL_LEN = 256
TEXT = "Describe this image in one short sentence, please."


@pytest.fixture(scope="module")
def kit(tiny_dirs: dict[str, Path]) -> ModelKit:
    return kit_for("llava", tiny_dirs["llava"])


@pytest.fixture(scope="module")
def engine(kit: ModelKit) -> Iterator[EngineHarness]:
    with EngineHarness(kit.path, "--max-model-len", str(MAX_MODEL_LEN)) as eng:
        yield eng


def assert_still_serving(kit: ModelKit, engine: EngineHarness) -> None:
    images = [image(1300)]
    [res] = engine.run(kit.request(TEXT, images, max_tokens=6))
    assert res.error is None and res.token_ids == kit.reference(TEXT, images, 6)
    stats = engine.call("stats")
    assert (stats["num_running"], stats["num_waiting"]) == (0, 0), stats
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"], stats


def bad_requests(kit: ModelKit) -> dict[str, tuple[EngineCoreRequest, str]]:
    base = kit.request(TEXT, [image(1301)], max_tokens=4)
    ids, feature = base.prompt_token_ids, base.mm_features[0]
    pixels = feature.data["pixel_values"]  # type: ignore[index]

    def params(**kw: object) -> EngineCoreRequest:
        return msgspec.structs.replace(
            base, request_id=new_id("bad"), sampling_params=SamplingParams(**kw)
        )

    def tokens(prompt: list[int], max_tokens: int = 4) -> EngineCoreRequest:
        return EngineCoreRequest(new_id("bad"), prompt, [], SamplingParams(max_tokens=max_tokens))

    def items(*features: MultiModalFeature) -> EngineCoreRequest:
        return msgspec.structs.replace(base, request_id=new_id("bad"), mm_features=list(features))

    shifted = PlaceholderRange(feature.placeholder.offset + 1, feature.placeholder.length)
    outside = PlaceholderRange(len(ids) - 2, feature.placeholder.length)
    invalid, too_long = "invalid_request", "context_length_exceeded"
    return {
        "token id = vocab size": (tokens([*ids[:5], kit.vocab_size]), invalid),
        "negative token id": (tokens([-1, *ids[:5]]), invalid),
        "empty prompt": (tokens([]), invalid),
        "n = 0": (params(n=0), invalid),
        "n = 17": (params(n=17), invalid),
        "n = 2 (P0 sends one request per choice)": (params(n=2), invalid),
        "negative temperature": (params(temperature=-1.0), invalid),
        "top_p = 0": (params(top_p=0.0), invalid),
        "max_tokens = 0": (params(max_tokens=0), invalid),
        "prompt over the context": (tokens(ids[:5] * 60), too_long),
        "prompt + max_tokens over the context": (tokens(ids[:5] * 50, 16), too_long),
        "placeholder outside the prompt": (
            items(msgspec.structs.replace(feature, placeholder=outside)),
            invalid,
        ),
        "overlapping items": (
            items(
                feature,
                msgspec.structs.replace(feature, mm_hash="b", placeholder=shifted),
            ),
            invalid,
        ),
        "tensors for another size": (
            with_data(base, [{"pixel_values": pixels[..., :8, :8]}]),
            invalid,
        ),
        "no pixel_values": (with_data(base, [{"other": np.zeros(3, np.float32)}]), invalid),
        "unknown shm segment": (
            with_data(base, [ShmAddress("mmis-nope", 0, 64, 1, 0, b"s" * 32)]),
            invalid,
        ),
        "unknown pooling type": (
            msgspec.structs.replace(
                base,
                request_id=new_id("bad"),
                sampling_params=None,
                pooling_params=PoolingParams(pooling_type="max"),
            ),
            invalid,
        ),
    }


def test_bad_requests_get_typed_error_outputs(kit: ModelKit, engine: EngineHarness) -> None:
    cases = bad_requests(kit)
    requests = [req for req, _ in cases.values()]
    results = engine.run(*requests)
    for (name, (_, code)), res in zip(cases.items(), results, strict=True):
        assert res.error is not None, f"{name}: no error"
        assert res.error.code == code, f"{name}: {res.error}"
        # refused at admission, never in a step (where it would fail its batch neighbours)
        assert res.error.message and "could not run" not in res.error.message, name
        assert res.finish_reason == {0: "error"} and res.num_outputs == 1, name
        assert res.token_ids == [], name
    assert engine.alive
    assert_still_serving(kit, engine)


def test_malformed_frames_are_dropped(kit: ModelKit, engine: EngineHarness) -> None:
    body = msgspec.msgpack.encode(["id", [1, 2, 3]])
    for frames in (
        [b"\x07", body],  # unknown request type
        [b"\x00", b"\xc1not msgpack"],
        [b"\x00", pickle.dumps({"request_id": "x"})],
        [b"\x00"],  # no body
        [b"\x02", msgspec.msgpack.encode([1])],  # a utility call without a method
    ):
        engine.push.send_multipart(frames)
    assert_still_serving(kit, engine)
    assert "dropped a malformed message" in engine.log_text()


def test_a_step_the_encoder_cannot_run_fails_only_its_request(
    kit: ModelKit, engine: EngineHarness
) -> None:
    """64x64 pixels expand to 64 placeholder tokens (admission agrees), but this LLaVA's
    vision tower takes 32x32 only: the runner fails that step, not the engine."""
    ids = kit.request(TEXT).prompt_token_ids
    prompt = [ids[0], *[kit.image_token_id] * 64, *ids[1:]]
    data = {"pixel_values": np.zeros((1, 3, 64, 64), np.float32)}
    feature = MultiModalFeature(
        modality="image", mm_hash="big", placeholder=PlaceholderRange(1, 64), data=data
    )
    for _ in range(2):  # the failed item leaves no stale encoder-cache entry behind
        req = EngineCoreRequest(new_id("enc"), prompt, [feature], SamplingParams(max_tokens=4))
        [res] = engine.run(req)
        assert res.error is not None and "could not run" in res.error.message, res.error
        assert res.finish_reason == {0: "error"}
    assert_still_serving(kit, engine)


def test_a_duplicate_id_is_refused_while_the_first_runs(
    kit: ModelKit, engine: EngineHarness
) -> None:
    req = kit.request(TEXT, max_tokens=64)
    engine.send(req)
    first = engine.results[req.request_id]
    engine.wait_until(lambda: bool(first.token_ids))
    seen = len(engine.batches)
    engine.send(msgspec.structs.replace(req))  # same id again
    dup = engine.results[req.request_id]
    engine.wait_until(lambda: dup.error is not None)
    assert dup.error is not None and "in use" in dup.error.message
    engine.wait_until(
        lambda: any(o.finish_reason == "length" for b in engine.batches[seen:] for o in b.outputs)
    )
    assert_still_serving(kit, engine)
