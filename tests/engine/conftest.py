"""Fixtures for the engine's torch-side tests.

- The tiny models are built once per session (fresh, into a session tmp dir), so a test never
  depends on a stale cache.
- ``Driver`` is a test-only stand-in for the scheduler: it allocates KV blocks sequentially,
  splits prompts into chunks, lets requests join at given steps, and feeds the runner one
  :class:`SchedulerOutput` per step.
- ``reference`` runs plain ``transformers`` ``generate(do_sample=False)`` on the same prompt.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from mmis.engine.execution.model import ModelAdapter, load_adapter
from mmis.engine.execution.runner import ModelRunner
from mmis.engine.scheduling.sched_output import (
    MultiModalInput,
    ScheduledRequest,
    SchedulerOutput,
    StepOutput,
)
from mmis.protocol.messages import PoolingParams, SamplingParams
from mmis.tiny_models.tiny_model import FAMILIES as ALL_FAMILIES
from mmis.tiny_models.tiny_model import build_tiny_model

# the families the runner-level tests (``family`` fixture) run; the engine-process tests of
# the others have files of their own (test_engine_gemma3.py, ...)
FAMILIES = ("llava", "qwen2-vl", "qwen2.5-vl", "llava-siglip")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {family: build_tiny_model(root / family, family) for family in ALL_FAMILIES}


@dataclasses.dataclass
class Family:
    """Everything a parity test needs for one model family."""

    name: str
    path: Path
    processor: Any
    hf_model: Any  # plain transformers model (sdpa), the reference
    adapter: ModelAdapter  # our adapter (paged attention)

    def image(self, seed: int, size: tuple[int, int] = (64, 64)) -> Image.Image:
        rng = np.random.default_rng(seed)
        return Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8))

    def prompt(self, text: str, num_images: int) -> str:
        parts: list[dict[str, str]] = [{"type": "image"} for _ in range(num_images)]
        parts.append({"type": "text", "text": text})
        messages = [{"role": "user", "content": parts}]
        return str(self.processor.apply_chat_template(messages, add_generation_prompt=True))

    def inputs(self, text: str, images: Sequence[Image.Image]) -> Any:
        prompt = self.prompt(text, len(images))
        return self.processor(text=[prompt], images=list(images) or None, return_tensors="pt")

    def request(
        self, text: str, images: Sequence[Image.Image]
    ) -> tuple[list[int], list[MultiModalInput], Any]:
        """Prompt token ids and multimodal items (placeholder runs of the image token)."""
        inputs = self.inputs(text, images)
        ids = inputs["input_ids"][0].tolist()
        tensors = self.adapter.split_processor_output(inputs) if images else []
        image_token = int(self.hf_model.config.image_token_id)
        runs, i = [], 0
        while i < len(ids):
            if ids[i] == image_token:
                j = i
                while j < len(ids) and ids[j] == image_token:
                    j += 1
                runs.append((i, j - i))
                i = j
            else:
                i += 1
        assert len(runs) == len(tensors)
        items = []
        for (offset, length), data in zip(runs, tensors, strict=True):
            digest = hashlib.sha256(np.asarray(data["pixel_values"]).tobytes()).hexdigest()[:16]
            grid = data.get("image_grid_thw")
            thw = tuple(int(v) for v in grid.reshape(-1).tolist()) if grid is not None else None
            items.append(MultiModalInput(digest, offset, length, data=data, grid_thw=thw))  # type: ignore[arg-type]
        return ids, items, inputs

    @torch.inference_mode()
    def reference(self, text: str, images: Sequence[Image.Image], max_new_tokens: int) -> list[int]:
        inputs = self.inputs(text, images)
        out = self.hf_model.generate(  # eos_token_id=[]: never stop early, like the driver
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[]
        )
        return [int(t) for t in out[0, inputs["input_ids"].shape[1] :].tolist()]

    def runner(self, num_blocks: int = 256, block_size: int = 16) -> ModelRunner:
        return ModelRunner.create(self.adapter, num_blocks=num_blocks, block_size=block_size)


_FAMILY_CACHE: dict[str, Family] = {}


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest, tiny_dirs: dict[str, Path]) -> Family:
    name = request.param
    if name not in _FAMILY_CACHE:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        path = tiny_dirs[name]
        hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        _FAMILY_CACHE[name] = Family(
            name=name,
            path=path,
            processor=AutoProcessor.from_pretrained(path),
            hf_model=hf,
            adapter=load_adapter(path, "cpu", torch.float32),
        )
    return _FAMILY_CACHE[name]


@dataclasses.dataclass
class _Req:
    request_id: str
    prompt: list[int]
    items: list[MultiModalInput]
    max_tokens: int
    join_step: int
    chunk: int
    sampling: SamplingParams | None
    pooling: PoolingParams | None
    eos: tuple[int, ...]
    computed: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)
    output: list[int] = dataclasses.field(default_factory=list)
    pooled: Any = None
    done: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class Driver:
    """Drives a runner step by step, like a (very simple) scheduler would."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.requests: list[_Req] = []
        self.next_block = 0
        self.steps = 0
        self.max_seqs_in_step = 0
        self.tokens_computed: dict[str, int] = {}
        self.outputs: list[StepOutput] = []

    def add(
        self,
        request_id: str,
        prompt: list[int],
        items: list[MultiModalInput],
        max_tokens: int = 12,
        join_step: int = 0,
        chunk: int = 10_000,
        sampling: SamplingParams | None = None,
        pooling: PoolingParams | None = None,
        prefix_from: str | None = None,
        prefix_blocks: int = 0,
        ignore_eos: bool = True,
    ) -> None:
        eos = () if ignore_eos else self.runner.adapter.eos_token_ids
        req = _Req(request_id, prompt, items, max_tokens, join_step, chunk, sampling, pooling, eos)
        if prefix_from is not None:
            donor = next(r for r in self.requests if r.request_id == prefix_from)
            req.blocks = donor.blocks[:prefix_blocks]
            req.computed = prefix_blocks * self.runner.block_size
            assert req.prompt[: req.computed] == donor.tokens[: req.computed]
        self.requests.append(req)
        self.tokens_computed[request_id] = 0

    def _blocks_for(self, req: _Req, end: int) -> list[int]:
        while len(req.blocks) * self.runner.block_size < end:
            req.blocks.append(self.next_block)
            self.next_block += 1
        return list(req.blocks)

    def step(self) -> None:
        seqs = []
        for req in self.requests:
            if req.done or req.join_step > self.steps:
                continue
            remaining = len(req.tokens) - req.computed
            n = min(req.chunk, remaining)
            end = req.computed + n
            data_items = [
                it
                if it.offset < end and it.end > req.computed
                else dataclasses.replace(it, data=None)
                for it in req.items
            ]
            seqs.append(
                ScheduledRequest(
                    request_id=req.request_id,
                    token_ids=req.tokens[req.computed : end],
                    start_position=req.computed,
                    block_table=self._blocks_for(req, end),
                    mm_items=data_items,
                    sample=end == len(req.tokens),
                    sampling_params=req.sampling,
                    pooling_params=req.pooling,
                )
            )
        self.max_seqs_in_step = max(self.max_seqs_in_step, len(seqs))
        out = self.runner.execute(SchedulerOutput(seqs)) if seqs else StepOutput()
        self.outputs.append(out)
        sampled = out.sampled_token_ids
        for seq in seqs:
            req = next(r for r in self.requests if r.request_id == seq.request_id)
            req.computed = seq.end_position
            self.tokens_computed[req.request_id] += seq.num_tokens
            if req.pooling is not None and seq.sample:
                req.pooled, req.done = out.pooled[req.request_id], True
            elif seq.request_id in sampled:
                token = sampled[seq.request_id]
                req.output.append(token)
                if token in req.eos or len(req.output) >= req.max_tokens:
                    req.done = True
        self.steps += 1

    def run(self, max_steps: int = 500) -> dict[str, list[int]]:
        while not all(r.done for r in self.requests):
            if self.steps >= max_steps:
                raise RuntimeError("driver did not finish")
            self.step()
        return {r.request_id: r.output for r in self.requests}

    def pooled(self, request_id: str) -> Any:
        return next(r for r in self.requests if r.request_id == request_id).pooled


@pytest.fixture
def driver_cls() -> type[Driver]:
    return Driver
