"""What the engine's caches save: encoder-cache hit vs miss, prefix-cache hit vs miss.

    .venv/bin/python benchmarks/bench_engine_caches.py [--model mmis-tiny|DIR]
        [--images 4] [--repeat 15] [--threads 1] [--device cpu|cuda]

The engine is wired exactly as ``mmis engine`` wires it (``engine/builder.py`` ``build``) and
driven in-process (no sockets, so only the engine's own work is timed); requests are built
by P0's real :class:`ModelProcessor`. Every request asks for ONE token, so its time is the
prefill step. Both sides of each ratio are measured in the same run, interleaved, medians:

- encoder cache (prefix caching OFF, so only the encoder output can be reused): a request
  whose ``--images`` images are new (the vision encoder runs) vs the same request again
  (its images' encoder outputs are cached);
- prefix cache (prefix caching ON): the same long prompt after ``reset_prefix_cache`` (a
  miss; the encoder outputs are cached on both sides, so only the KV reuse differs) vs
  again right after (a hit covering every full block).

Prints the details, then one summary line to paste.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmis.engine.builder import build
from mmis.engine.config import EngineConfig
from mmis.engine.core import EngineCore
from mmis.entrypoints.common import resolve_model, setup_logging
from mmis.frontend.client.processor import ModelProcessor
from mmis.protocol.messages import (
    EngineCoreRequest,
    MultiModalFeature,
    SamplingParams,
)

TEXT = (
    "Describe these images in one short sentence, please. What is in the picture? "
    "A red square, a blue circle and a green line. A cat sits on a warm mat near the "
    "window while it rains outside. The quick brown fox jumps over the lazy dog. "
)
_IDS = itertools.count()


def make_request(proc: ModelProcessor, seeds: list[int], text: str) -> EngineCoreRequest:
    """A chat request with one random image per seed (hash = the seed: same seed, same item)."""
    parts: list[dict[str, str]] = [{"type": "image"} for _ in seeds]
    parts.append({"type": "text", "text": text})
    ids = proc.tokenize(proc.chat_prompt([{"role": "user", "content": parts}]))
    images = [
        Image.fromarray(np.random.default_rng(s).integers(0, 255, (64, 64, 3), dtype=np.uint8))
        for s in seeds
    ]
    processed = [proc.process_image(img) for img in images]
    ids, ranges = proc.expand(ids, [p.num_tokens for p in processed])
    features = [
        MultiModalFeature(modality="image", mm_hash=f"img-{s}", placeholder=r, data=p.tensors)
        for s, r, p in zip(seeds, ranges, processed, strict=True)
    ]
    return EngineCoreRequest(
        f"bench-{next(_IDS)}", ids, features, SamplingParams(temperature=0.0, max_tokens=1)
    )


def timed(core: EngineCore, request: EngineCoreRequest) -> float:
    """Seconds from admission to the request's (single-token) finish."""
    request = EngineCoreRequest(
        f"bench-{next(_IDS)}",
        request.prompt_token_ids,
        request.mm_features,
        request.sampling_params,
    )
    start = time.perf_counter()
    core.add_request(request)
    while True:
        for out in core.step():
            if out.request_id == request.request_id and out.finish_reason is not None:
                if out.error is not None:
                    raise RuntimeError(f"benchmark request failed: {out.error}")
                return time.perf_counter() - start


def engine(model: str, device: str, prefix: bool) -> EngineCore:
    cfg = EngineConfig(model=model, device=device, enable_prefix_caching=prefix, num_kv_blocks=4096)
    core: EngineCore = build(cfg, str(resolve_model(model)), setup_logging).core
    return core


def encoder_cache(core: EngineCore, proc: ModelProcessor, images: int, repeat: int) -> Any:
    miss, hit, seed = [], [], 10_000
    for _ in range(repeat):
        request = make_request(proc, list(range(seed, seed + images)), TEXT)
        seed += images
        miss.append(timed(core, request))  # new images: the encoder runs
        hit.append(timed(core, request))  # same images: encoder outputs are cached
    return statistics.median(miss), statistics.median(hit)


def prefix_cache(core: EngineCore, proc: ModelProcessor, images: int, repeat: int) -> Any:
    request = make_request(proc, list(range(images)), TEXT * 2)
    timed(core, request)  # warm: the encoder outputs are cached from here on
    miss, hit, cached = [], [], 0
    for _ in range(repeat):
        core.utilities()["reset_prefix_cache"]()
        miss.append(timed(core, request))
        before = core.stats()["prefix_cache_hits"]
        hit.append(timed(core, request))
        cached = core.stats()["prefix_cache_hits"] - before
    return statistics.median(miss), statistics.median(hit), cached, len(request.prompt_token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mmis-tiny")
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    proc = ModelProcessor.from_pretrained(path)

    core = engine(path, args.device, prefix=False)
    timed(core, make_request(proc, [1], TEXT))  # warm-up
    enc_miss, enc_hit = encoder_cache(core, proc, args.images, args.repeat)
    calls = core.runner.num_encoder_calls
    print(
        f"encoder cache ({args.images} images, prefix caching off): miss "
        f"{enc_miss * 1e3:.1f} ms, hit {enc_hit * 1e3:.1f} ms, "
        f"ratio {enc_miss / enc_hit:.2f}x ({calls} encoder calls)"
    )

    core = engine(path, args.device, prefix=True)
    pre_miss, pre_hit, cached, total = prefix_cache(core, proc, args.images, args.repeat)
    print(
        f"prefix cache ({total}-token prompt, {cached} tokens hit): miss "
        f"{pre_miss * 1e3:.1f} ms, hit {pre_hit * 1e3:.1f} ms, ratio {pre_miss / pre_hit:.2f}x"
    )
    name = args.model if args.model.startswith("mmis-tiny") else path
    print(
        f"SUMMARY bench_engine_caches {name} {args.device} threads={args.threads}: "
        f"encoder-cache hit {enc_miss / enc_hit:.2f}x faster prefill "
        f"({enc_miss * 1e3:.1f} -> {enc_hit * 1e3:.1f} ms, {args.images} images); "
        f"prefix-cache hit {pre_miss / pre_hit:.2f}x faster prefill "
        f"({pre_miss * 1e3:.1f} -> {pre_hit * 1e3:.1f} ms, {cached}/{total} tokens cached)"
    )


if __name__ == "__main__":
    main()
