"""The engine benchmark's workload and the three sides that run it (see ``bench_engine.py``).

Invariants:
- Every side starts from the same processor output: one chat prompt with its own 64x64 image
  per request, run through the model's Hugging Face processor once, before any timing.
- Every side produces exactly ``tokens`` greedy tokens per request (EOS ignored), and returns
  them per request in workload order, so the sides can be compared token for token.
- The engine side is :class:`EngineCore` wired as ``mmis engine`` wires it (scheduler with
  :class:`EngineConfig`'s defaults, the model's EOS, the model's context
  length; no sockets, no receiver cache, tracing off). A fresh scheduler and core are built
  for every timed run (untimed), so no run benefits from a previous run's prefix or encoder
  cache; one :class:`ModelRunner` (the KV pool) is shared, its encoder-output store cleared.
- An engine request that ends with an error, or an engine that stops with requests unfinished,
  raises :class:`BenchmarkError`: a benchmark never reports figures for failed work.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmis.config import GiB
from mmis.engine.builder import make_core
from mmis.engine.config import EngineConfig
from mmis.engine.core import EngineCore
from mmis.engine.execution.model import ModelAdapter
from mmis.engine.execution.runner import ModelRunner
from mmis.engine.scheduling.sched_output import MultiModalInput, ScheduledRequest, SchedulerOutput
from mmis.protocol.messages import (
    EngineCoreRequest,
    FinishReason,
    MultiModalFeature,
    PlaceholderRange,
    SamplingParams,
)

ENGINE_DEFAULTS = EngineConfig()


class BenchmarkError(RuntimeError):
    """A side did not produce the work it was asked for."""


@dataclasses.dataclass(frozen=True)
class Item:
    """One request of the workload: processor output, prompt ids and its one image."""

    inputs: Any  # the processor's BatchFeature (on the benchmark device), for generate()
    ids: list[int]
    data: Mapping[str, np.ndarray]  # the image's tensors as on the wire (numpy)
    offset: int
    length: int
    mm_hash: str


def build_workload(processor: Any, adapter: ModelAdapter, count: int) -> list[Item]:
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}],
        }
    ]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    image_token = int(adapter.model.config.image_token_id)
    items = []
    for k in range(count):
        pixels = np.random.default_rng(k).integers(0, 255, (64, 64, 3), dtype=np.uint8)
        inputs = processor(text=[prompt], images=[Image.fromarray(pixels)], return_tensors="pt")
        ids = [int(t) for t in inputs["input_ids"][0].tolist()]
        (data,) = adapter.split_processor_output(inputs)
        wire = {name: np.asarray(value) for name, value in data.items()}
        digest = hashlib.sha256(wire["pixel_values"].tobytes()).hexdigest()[:24]
        inputs = inputs.to(adapter.device)
        if "pixel_values" in inputs and inputs["pixel_values"].is_floating_point():
            inputs["pixel_values"] = inputs["pixel_values"].to(adapter.dtype)
        offset = ids.index(image_token)
        items.append(Item(inputs, ids, wire, offset, ids.count(image_token), digest))
    return items


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------- baseline
def run_baseline(model: Any, items: list[Item], tokens: int) -> list[list[int]]:
    """One ``generate(do_sample=False)`` per request, in turn."""
    results = []
    for item in items:
        gen = model.generate(**item.inputs, max_new_tokens=tokens, do_sample=False, eos_token_id=[])
        results.append([int(t) for t in gen[0, len(item.ids) :].tolist()])
    return results


# ---------------------------------------------------------------------------- runner only
def run_runner(runner: ModelRunner, items: list[Item], tokens: int) -> list[list[int]]:
    """The runner alone: every request in flight, one batched step per output token."""
    block = runner.block_size
    runner.encoder_outputs.clear()
    next_block = 1  # block 0 is the pool's reserved null block
    seqs = []
    for k, item in enumerate(items):
        need = (len(item.ids) + tokens + block - 1) // block
        table = list(range(next_block, next_block + need))
        next_block += need
        mm = [MultiModalInput(item.mm_hash, item.offset, item.length, data=item.data)]
        seqs.append(ScheduledRequest(f"r{k}", item.ids, 0, table, mm))
    if next_block > runner.pool.num_blocks:
        raise BenchmarkError(f"{next_block} KV blocks needed, pool has {runner.pool.num_blocks}")
    outputs: list[list[int]] = [[] for _ in items]
    for _ in range(tokens):
        out = runner.execute(SchedulerOutput(seqs))
        nxt, sampled = [], out.sampled_token_ids
        for k, seq in enumerate(seqs):
            token = sampled[seq.request_id]
            outputs[k].append(token)
            mm = [dataclasses.replace(it, data=None) for it in seq.mm_items]
            nxt.append(
                ScheduledRequest(seq.request_id, [token], seq.end_position, seq.block_table, mm)
            )
        seqs = nxt
    return outputs


# ---------------------------------------------------------------------------- whole engine
def engine_runner(adapter: ModelAdapter) -> ModelRunner:
    """The KV pool and runner as ``mmis engine`` sizes them by default."""
    cfg = ENGINE_DEFAULTS
    kv_bytes = None if cfg.kv_cache_gb is None else int(cfg.kv_cache_gb * GiB)
    num_blocks = cfg.num_kv_blocks
    if kv_bytes is None and num_blocks is None:
        num_blocks = 2048  # what ``build`` picks when neither is set
    return ModelRunner.create(
        adapter, block_size=cfg.block_size, num_blocks=num_blocks, kv_budget_bytes=kv_bytes
    )


def engine_core(runner: ModelRunner) -> EngineCore:
    """A fresh scheduler + core around ``runner``, built as ``mmis engine`` builds its own."""
    runner.encoder_outputs.clear()  # no embeddings left over from a previous run
    return make_core(ENGINE_DEFAULTS, runner)


def engine_requests(items: list[Item], tokens: int) -> list[EngineCoreRequest]:
    """The workload as P0 would send it: every item carries its tensors."""
    requests = []
    for k, item in enumerate(items):
        feature = MultiModalFeature(
            modality="image",
            mm_hash=item.mm_hash,
            placeholder=PlaceholderRange(item.offset, item.length),
            data=dict(item.data),
        )
        requests.append(
            EngineCoreRequest(
                request_id=f"bench-{k}",
                prompt_token_ids=list(item.ids),
                mm_features=[feature],
                sampling_params=SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
            )
        )
    return requests


def run_engine(core: EngineCore, requests: list[EngineCoreRequest]) -> list[list[int]]:
    """Submit every request, then ``core.step()`` until all have finished."""
    order = {r.request_id: k for k, r in enumerate(requests)}
    outputs: list[list[int]] = [[] for _ in requests]
    for request in requests:
        core.add_request(request)
    unfinished = set(order)
    while unfinished:
        if not core.has_work():
            raise BenchmarkError(f"engine idle with {len(unfinished)} request(s) unfinished")
        for out in core.step():
            if out.finish_reason == FinishReason.ERROR.value:
                message = out.error.message if out.error is not None else "no message"
                raise BenchmarkError(f"engine failed request {out.request_id}: {message}")
            outputs[order[out.request_id]].extend(out.new_token_ids)
            if out.finish_reason is not None:
                unfinished.discard(out.request_id)
    return outputs
