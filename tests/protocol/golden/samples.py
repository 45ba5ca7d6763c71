"""Canonical sample messages for the golden wire fixtures, and helpers shared with tests.

Layout of this folder:
- ``<version>/<sample>.msgpack``: the frames of one encoded sample, stored as a msgpack
  array of bin values (a test-only container; on the wire each item is one ZMQ frame).
- ``<version>/schema.json``: every wire struct's description at that version.

``CURRENT_VERSION`` is what the current code must reproduce byte for byte. When a field is
appended (or retired in place, ``protocol/schema.py``) after a release, bump it and
regenerate (``regenerate.py``): older version folders stay as they are and keep proving that
the current decoders read them. v6 retired ``MultiModalFeature``'s second hash; v7 appended
``EngineCoreOutputs.stored_mm_items`` (``CachedItem``) and ``shadow_reset``; v8 appended
``EngineCoreRequest.lora_name`` and ``lora_id`` (multi-LoRA, issue 47).

Every sample is deterministic (no randomness, no clocks), so its encoding is stable.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from mmis.protocol import (
    AbortRequests,
    CachedItem,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    MultiModalFeature,
    PlaceholderRange,
    PoolingParams,
    RequestError,
    SamplingParams,
    ShmAddress,
    StructuredOutputs,
    TensorHeader,
    TokenLogprobs,
    UtilityCall,
    UtilityResult,
    WireCodec,
)

GOLDEN_DIR = Path(__file__).resolve().parent
CURRENT_VERSION = "v8"
SUFFIX = ".msgpack"


@dataclass(frozen=True)
class Sample:
    name: str
    kind: str  # "request" (type byte first), "outputs" or "struct" ([body, *tensors])
    message: Any


def _pixels() -> np.ndarray:  # 768 B: rides in its own frame
    return (np.arange(3 * 8 * 8, dtype=np.float32) / 7.0).reshape(1, 3, 8, 8)


def _grid() -> np.ndarray:  # 24 B: inline
    return np.array([[1, 4, 4]], dtype=np.int64)


def _bf16() -> torch.Tensor:  # 320 B of bfloat16: its own frame, decoded as torch
    return (torch.arange(160, dtype=torch.float32) / 3.0).to(torch.bfloat16).reshape(4, 40)


def _shm() -> ShmAddress:
    return ShmAddress("mmis-shm-0", 4096, 768, 17, 3, bytes(range(32)))


def _features() -> list[MultiModalFeature]:
    return [
        MultiModalFeature(
            modality="image",
            mm_hash="a1" * 32,
            placeholder=PlaceholderRange(3, 16),
            data={"pixel_values": _pixels()},
        ),
        MultiModalFeature(
            modality="image", mm_hash="b2" * 32, placeholder=PlaceholderRange(20, 16), data=None
        ),
        MultiModalFeature(
            modality="image", mm_hash="c3" * 32, placeholder=PlaceholderRange(37, 16), data=_shm()
        ),
        MultiModalFeature(
            modality="image",
            mm_hash="d4" * 32,
            placeholder=PlaceholderRange(54, 4),
            data={"pixel_values": _bf16(), "image_grid_thw": _grid()},
        ),
    ]


def _error() -> RequestError:
    return RequestError("multimodal_cache_miss", "2 multimodal item(s) not in the cache", True)


def _param_error() -> RequestError:
    return RequestError(
        "invalid_request", "regex: unbalanced parenthesis", False, "response_format"
    )


def samples() -> list[Sample]:
    sampling = SamplingParams(
        2,
        0.7,
        0.9,
        50,
        1234,
        64,
        ["</s>", "\n\n"],
        [2, 7],
        False,
        0.5,
        -0.25,
        1.1,
        0.05,
        {9: 5.0},
        2,
        StructuredOutputs("json", '{"type": "object"}', "response_format"),
        2,
    )
    logprobs = TokenLogprobs(
        [[11, 4, 11], [12, 12, 3]], [[-0.5, -0.25, -0.5], [-0.125, -0.125, -3.0]], [2, 1]
    )
    prompt_logprobs = TokenLogprobs([[1], [2, 2, 9]], [[], [-1.5, -1.5, -2.0]], [0, 1])
    token_output = EngineCoreOutput(
        "req-1", [11, 12], None, None, [], 1, 58, 16, None, None, logprobs, prompt_logprobs
    )
    miss_output = EngineCoreOutput(
        "req-2", [], "error", _error(), ["b2" * 32, "e5" * 32], 0, 0, 0, None, None
    )
    pooled_output = EngineCoreOutput(
        "req-3", [], "stop", None, [], 0, 9, 0, np.linspace(-1, 1, 128, dtype=np.float32), 2
    )
    return [
        Sample(
            "add_request",
            "request",
            EngineCoreRequest(
                "req-1",
                list(range(1, 60)),
                _features(),
                sampling,
                None,
                1700000000.25,
                {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
                False,
                1,
                "tenant-a-lora",
                3,
            ),
        ),
        Sample(
            "add_request_pooling",
            "request",
            EngineCoreRequest("req-3", [5, 6, 7], [], None, PoolingParams("last", False), 2.5),
        ),
        Sample("add_request_minimal", "request", EngineCoreRequest("req-0", [1])),
        Sample("abort_requests", "request", AbortRequests(["req-1", "req-2"], 1)),
        Sample(
            "utility_call",
            "request",
            UtilityCall(7, "reset_mm_cache", [1, "x", [1.5, None], {"k": True}], 2),
        ),
        Sample(
            "outputs",
            "outputs",
            EngineCoreOutputs(
                [token_output, miss_output, pooled_output],
                0,
                1700000001.5,
                "epoch-6f1c",
                ["f6" * 32],
                UtilityResult(7, True, {"freed": 3}),
                [CachedItem("a1" * 32, 896, 16), CachedItem("d4" * 32, 512, 4)],
                True,
            ),
        ),
        Sample(
            "outputs_utility_error",
            "outputs",
            EngineCoreOutputs(
                [], 1, 3.0, "epoch-6f1c", [], UtilityResult(8, False, None, _error())
            ),
        ),
        Sample("outputs_empty", "outputs", EngineCoreOutputs()),
        Sample("struct_PlaceholderRange", "struct", PlaceholderRange(5, 256)),
        Sample("struct_ShmAddress", "struct", _shm()),
        Sample("struct_TensorHeader", "struct", TensorHeader("float32", (2,), b"\0" * 8)),
        Sample("struct_MultiModalFeature", "struct", _features()[3]),
        Sample("struct_SamplingParams", "struct", SamplingParams()),
        Sample("struct_StructuredOutputs", "struct", StructuredOutputs("regex", "[0-9]{3}")),
        Sample("struct_PoolingParams", "struct", PoolingParams()),
        Sample("struct_RequestError", "struct", _error()),
        Sample("struct_RequestError_param", "struct", _param_error()),
        Sample("struct_TokenLogprobs", "struct", TokenLogprobs([[5]], [[-0.75]], [1])),
        Sample("struct_UtilityResult", "struct", UtilityResult(9, True, [1, "two", 3.0])),
        Sample("struct_EngineCoreOutput", "struct", pooled_output),
        Sample("struct_CachedItem", "struct", CachedItem("e5" * 32, 12_448, 576)),
    ]


def encode_sample(codec: WireCodec, sample: Sample) -> list[Any]:
    if sample.kind == "request":
        return codec.encode_request(sample.message)
    if sample.kind == "outputs":
        return codec.encode_outputs(sample.message)
    return codec.encode(sample.message)


def body_and_tensors(sample: Sample, frames: list[Any]) -> list[Any]:
    """The ``[body, *tensor_frames]`` part of a sample's frames (drops a type byte)."""
    return frames[1:] if sample.kind == "request" else frames


def write_frames(path: Path, frames: list[Any]) -> None:
    path.write_bytes(msgspec.msgpack.encode([bytes(frame) for frame in frames]))


def read_frames(path: Path) -> list[bytes]:
    return msgspec.msgpack.decode(path.read_bytes(), type=list[bytes])


def fixture_path(name: str, version: str = CURRENT_VERSION) -> Path:
    return GOLDEN_DIR / version / f"{name}{SUFFIX}"


def versions() -> list[str]:
    return sorted(p.name for p in GOLDEN_DIR.iterdir() if p.is_dir() and p.name[:1] == "v")


def assert_same(expected: Any, actual: Any, path: str = "msg") -> None:
    """Deep equality that understands arrays, tensors and (possibly other-version) structs.

    Structs compare field by field over the fields both types have, so a message decoded
    into a next-version struct can be compared with the current-version original.
    """
    if isinstance(expected, msgspec.Struct):
        assert isinstance(actual, msgspec.Struct), f"{path}: expected a struct, got {actual!r}"
        names = set(expected.__struct_fields__) & set(actual.__struct_fields__)
        assert names == set(expected.__struct_fields__) or names == set(actual.__struct_fields__), (
            f"{path}: unrelated structs {type(expected).__name__}/{type(actual).__name__}"
        )
        for name in expected.__struct_fields__:
            if name in names:
                assert_same(getattr(expected, name), getattr(actual, name), f"{path}.{name}")
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), f"{path}: expected ndarray, got {type(actual)}"
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), path
        assert np.array_equal(actual, expected), f"{path}: values differ"
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: expected tensor, got {type(actual)}"
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), path
        assert torch.equal(actual, expected), f"{path}: values differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and list(actual) == list(expected), path
        for key in expected:
            assert_same(expected[key], actual[key], f"{path}[{key!r}]")
    elif isinstance(expected, list | tuple):
        assert isinstance(actual, list | tuple) and len(actual) == len(expected), path
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_same(e, a, f"{path}[{i}]")
    else:
        assert type(actual) is type(expected) and actual == expected, (
            f"{path}: expected {expected!r}, got {actual!r}"
        )
