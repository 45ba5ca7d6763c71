"""Async scheduling (issue 44 item 5): the real engine core on the tiny LLaVA and Qwen2-VL
gives every request the same tokens with ``async_scheduling="on"`` as with ``"off"``.

Each case runs the same workload through two cores built by ``make_core`` (the real
scheduler, KV/prefix cache, encoder cache, runner, sampler and transformers model; CPU, where
async is forced on): greedy and seeded sampling, EOS (the model's own EOS list replaced by a
token it emits), ``stop_token_ids``, ``max_tokens`` of 1 and more, aborts mid-generation, an
image request, chunked prefill, preemption under a tiny KV pool, prefix-cache hits, and rows
that cannot overlap (penalties, logprobs). Compared: every request's tokens, finish and stop
reasons, logprobs; the prefix cache's block keys (computed from real tokens, never a
placeholder); no KV block left held. Each async run must really overlap: some step launched
while the previous one was in flight, with rows whose token came from that step's sampled
ids on the device (``pending_rows``), and every launch of such a step is checked to make no
host sync (``sync_guard.ForwardGuard`` around the whole launch: patch, forward and sampler),
except a step that runs the vision encoder: transformers' Qwen2-VL vision code reads its
patch grid on the host (such a launch waits for the step in flight there; exact all the same).
Last, a real ``mmis engine --async-scheduling on`` process over its ZMQ sockets gives
transformers ``generate()``'s greedy tokens for concurrent text and image requests.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_harness import EngineHarness
from engine_inputs import ModelKit, image
from sync_guard import ForwardGuard

from mmis.engine.builder import make_core
from mmis.engine.config import EngineConfig
from mmis.engine.core import EngineCore
from mmis.engine.execution.model import ModelAdapter, load_adapter
from mmis.engine.execution.runner import ModelRunner
from mmis.protocol.messages import EngineCoreRequest, SamplingParams
from mmis.tiny_models.tiny_model import build_tiny_model

pytestmark = pytest.mark.model

FAMILIES = ("llava", "qwen2-vl")
_LOADED: dict[str, tuple[ModelKit, ModelAdapter]] = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("async-sched")


@pytest.fixture(params=FAMILIES)
def kit(request: pytest.FixtureRequest, models: Path) -> tuple[ModelKit, ModelAdapter]:
    family = request.param
    if family not in _LOADED:
        path = models / family
        if not path.exists():
            build_tiny_model(path, family)
        _LOADED[family] = (ModelKit.load(family, path), load_adapter(path, "cpu", torch.float32))
    return _LOADED[family]


@dataclasses.dataclass
class Outcome:
    """What one request got."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    finish: str | None = None
    stop: Any = None
    logprobs: list[Any] = dataclasses.field(default_factory=list)
    error: Any = None


@dataclasses.dataclass
class Run:
    outcomes: dict[str, Outcome]
    cached_keys: set[bytes]
    preemptions: int
    prefix_hits: int
    pending_rows: int  # rows launched with a placeholder token (0 when synchronous)


@dataclasses.dataclass
class Job:
    request: EngineCoreRequest
    after: tuple[str, int] | None = None  # admit once that request has that many tokens
    abort_at: int | None = None  # abort once it has this many tokens


def _allowed(violation: Any) -> bool:
    """Outside the forward a launch may upload host data (``torch.tensor``: the step's one
    upload, which on CPU is ``torch.from_numpy``; the sampler's small per-row tensors): an
    upload never waits for the device. On CPU only, the argmax runs in numpy
    (``sampler._argmax``; torch's on CUDA). Anything that reads device data on the host, or
    waits for the device, fails."""
    return violation.op == "aten.lift_fresh.default" or (
        "sampler.py" in violation.where and "(_argmax)" in violation.where
    )


def _run(
    adapter: ModelAdapter,
    jobs: Sequence[Job],
    mode: str,
    *,
    num_blocks: int = 256,
    eos: Sequence[int] | None = None,
    guard: bool = False,
    **limits: Any,
) -> Run:
    runner = ModelRunner.create(adapter, num_blocks=num_blocks, block_size=16)
    core = make_core(EngineConfig(async_scheduling=mode, **limits), runner)
    assert core.async_scheduling is (mode == "on")
    if eos is not None:
        core.eos_token_ids = tuple(eos)
    pending = [0]
    launch = runner.launch

    def spy(batch: Any, histories: Any = None) -> Any:
        pending[0] += len(batch.pending_rows)
        encodes = any(row.encoder_inputs for row in batch.scheduled)
        if not (guard and batch.pending_rows) or encodes:  # see the module docstring
            return launch(batch, histories)
        check = ForwardGuard()
        with check:
            launched = launch(batch, histories)
        bad = [v for v in check.violations if not _allowed(v)]
        assert not bad, bad
        return launched

    runner.launch = spy  # type: ignore[method-assign]
    outcomes = {job.request.request_id: Outcome() for job in jobs}
    waiting = list(jobs)
    aborted: set[str] = set()

    def admit() -> None:
        for job in list(waiting):
            if job.after is None or len(outcomes[job.after[0]].tokens) >= job.after[1]:
                waiting.remove(job)
                core.add_request(job.request)

    admit()
    for _ in range(2000):
        if not core.has_work():
            assert not waiting, f"never admitted: {[j.request.request_id for j in waiting]}"
            break
        for out in core.step():
            got = outcomes[out.request_id]
            assert got.finish is None, f"{out.request_id}: an output after its end"
            assert out.request_id not in aborted, f"{out.request_id}: an output after its abort"
            got.tokens += out.new_token_ids
            if out.logprobs is not None:
                got.logprobs += [out.logprobs.token_ids, out.logprobs.logprobs]
            got.finish, got.stop, got.error = out.finish_reason, out.stop_reason, out.error
        for job in jobs:
            rid = job.request.request_id
            due = job.abort_at is not None and len(outcomes[rid].tokens) >= job.abort_at
            if due and rid not in aborted:
                core.abort_requests([rid])
                aborted.add(rid)
        admit()
    else:
        raise AssertionError("the engine never ran out of work")
    kv = core.scheduler.kv
    assert not kv.req_blocks, f"blocks still held: {list(kv.req_blocks)}"
    assert kv.num_free_blocks == kv.num_usable_blocks
    stats = core.stats()
    return Run(
        outcomes,
        set(kv.pool.cached),
        stats["num_preemptions"],
        stats["prefix_cache_hits"],
        pending[0],
    )


def _same(adapter: ModelAdapter, jobs: Callable[[], list[Job]], **kw: Any) -> tuple[Run, Run]:
    """The workload synchronously and with async scheduling: identical outcomes and keys."""
    sync = _run(adapter, jobs(), "off", **kw)
    ahead = _run(adapter, jobs(), "on", guard=True, **kw)
    assert sync.pending_rows == 0
    assert ahead.pending_rows > 0, "async scheduling never overlapped a step"
    for rid, want in sync.outcomes.items():
        assert ahead.outcomes[rid] == want, rid
    assert ahead.cached_keys == sync.cached_keys
    return sync, ahead


def _req(
    kit: ModelKit, rid: str, text: str, images: Sequence[Any] = (), **params: Any
) -> EngineCoreRequest:
    request = kit.request(text, list(images), request_id=rid)
    base = request.sampling_params
    assert base is not None
    fields = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True} | params
    return msgspec.structs.replace(request, sampling_params=msgspec.structs.replace(base, **fields))


TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Describe a sunny day at the beach in detail.",
    "List three colours of the rainbow, please.",
    "What is the capital of the country north of here?",
)


def test_greedy_and_seeded_tokens_match_with_stops_and_an_image(kit):
    kit_, adapter = kit
    probe = _run(adapter, [Job(_req(kit_, "p", TEXTS[0], max_tokens=10))], "off")
    emitted = probe.outcomes["p"].tokens
    assert len(emitted) == 10
    stop_id, eos_id = emitted[3], emitted[6]

    def jobs() -> list[Job]:
        return [
            Job(_req(kit_, "greedy", TEXTS[0], max_tokens=16)),
            Job(_req(kit_, "one", TEXTS[1], max_tokens=1)),
            Job(_req(kit_, "two", TEXTS[2], max_tokens=2)),
            Job(_req(kit_, "stop", TEXTS[0], max_tokens=16, stop_token_ids=[stop_id])),
            Job(_req(kit_, "eos", TEXTS[0], max_tokens=16, ignore_eos=False)),
            Job(_req(kit_, "seeded", TEXTS[3], temperature=0.9, seed=7, max_tokens=14)),
            Job(_req(kit_, "seeded2", TEXTS[1], temperature=1.3, top_k=20, seed=3)),
            Job(_req(kit_, "image", TEXTS[1], [image(5)], max_tokens=10), after=("greedy", 3)),
            Job(_req(kit_, "late", TEXTS[2], max_tokens=9), after=("seeded", 5)),
        ]

    sync, _ = _same(adapter, jobs, eos=[eos_id])
    got = sync.outcomes
    assert got["stop"].finish == "stop" and got["stop"].stop == stop_id
    assert got["stop"].tokens[-1] == stop_id and len(got["stop"].tokens) <= 4
    assert got["eos"].finish == "stop" and got["eos"].tokens[-1] == eos_id
    assert len(got["one"].tokens) == 1 and got["one"].finish == "length"
    assert len(got["two"].tokens) == 2 and got["greedy"].finish == "length"
    assert len(got["seeded"].tokens) == 14 and len(got["image"].tokens) == 10


def test_aborts_chunked_prefill_and_prefix_hits(kit):
    kit_, adapter = kit
    long = " ".join(TEXTS * 3)

    def jobs() -> list[Job]:
        return [
            Job(_req(kit_, "a", long, max_tokens=12)),
            Job(_req(kit_, "abort3", TEXTS[1], max_tokens=20), abort_at=3),
            Job(_req(kit_, "abort1", TEXTS[2], max_tokens=20), abort_at=1),
            Job(_req(kit_, "hit", long, max_tokens=8), after=("a", 12)),  # a's blocks cached
            Job(_req(kit_, "hit-img", long, [image(9)], max_tokens=6), after=("a", 4)),
        ]

    sync, ahead = _same(adapter, jobs, max_num_batched_tokens=48)
    assert sync.outcomes["abort3"].tokens and len(sync.outcomes["abort3"].tokens) == 3
    assert len(sync.outcomes["abort1"].tokens) == 1
    assert sync.outcomes["abort3"].finish is None  # an abort sends nothing more
    assert sync.prefix_hits > 0 and ahead.prefix_hits > 0


def test_preemption_under_a_tiny_kv_pool(kit):
    kit_, adapter = kit

    def jobs() -> list[Job]:
        return [
            Job(_req(kit_, f"r{i}", TEXTS[i % 4], max_tokens=40, seed=i, temperature=0.7))
            for i in range(4)
        ]

    prompt = len(jobs()[0].request.prompt_token_ids)
    blocks = 1 + 2 * -(-(prompt + 40) // 16) + 1  # two requests fit, four must take turns
    sync, ahead = _same(adapter, jobs, num_blocks=blocks)
    assert sync.preemptions > 0 and ahead.preemptions > 0
    assert all(len(o.tokens) == 40 for o in sync.outcomes.values())


def test_rows_that_cannot_overlap_fall_back_and_match(kit):
    kit_, adapter = kit

    def jobs() -> list[Job]:
        return [
            Job(_req(kit_, "plain", TEXTS[0], max_tokens=30)),
            # llava: the placeholder missing from its history changes this one's tokens
            Job(_req(kit_, "penalty", TEXTS[3], max_tokens=24, frequency_penalty=2.0)),
            Job(_req(kit_, "presence", TEXTS[3], max_tokens=24, presence_penalty=2.0)),
            Job(_req(kit_, "rep", TEXTS[1], max_tokens=5, repetition_penalty=3.0)),
            Job(_req(kit_, "logprobs", TEXTS[2], max_tokens=10, logprobs=2)),
            Job(_req(kit_, "bias", TEXTS[3], max_tokens=10, logit_bias={5: 3.0}, min_p=0.1)),
        ]

    sync, _ = _same(adapter, jobs)
    assert len(sync.outcomes["logprobs"].logprobs) == 20  # ids and values of 10 tokens


def test_the_default_is_synchronous_on_cpu(kit):
    _, adapter = kit
    runner = ModelRunner.create(adapter, num_blocks=16, block_size=16)
    core: EngineCore = make_core(EngineConfig(), runner)
    assert core.async_scheduling is False
    assert make_core(EngineConfig(async_scheduling="on"), runner).async_scheduling is True


@pytest.mark.slow
def test_engine_process_with_async_scheduling_matches_generate(kit):
    kit_, _ = kit
    texts = [(TEXTS[0], []), (TEXTS[1], [image(3)]), (TEXTS[2], []), (TEXTS[3], [image(4)])]
    requests = [
        _req(kit_, f"e2e-{i}", text, images, max_tokens=6 + 3 * i)
        for i, (text, images) in enumerate(texts)
    ]
    with EngineHarness(kit_.path, "--async-scheduling", "on") as engine:
        results = engine.run(*requests)
        log = engine.log_text()
    assert "async scheduling: on" in log
    for (text, images), request, result in zip(texts, requests, results, strict=True):
        assert request.sampling_params is not None
        want = kit_.reference(text, images, request.sampling_params.max_tokens)
        assert result.token_ids == want, request.request_id
        assert result.finish_reason == {0: "length"}


def test_a_request_preempted_with_its_token_in_flight_still_gets_that_token():
    """Scheduler level: a pass that runs before the update of the step in flight preempts a
    request whose token that step sampled; the update appends it (and sends it) as the
    synchronous loop would have before the pass. (Through the real core this cannot be seen
    in the tokens: a greedy or seeded request recomputed without its token samples the same
    token again at the same position.)"""
    from mmis.engine.scheduling.request import Request, RequestStatus
    from mmis.engine.scheduling.sched_config import SchedulerConfig
    from mmis.engine.scheduling.scheduler import Scheduler

    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=4, max_num_seqs=2))
    sched.async_scheduling = True  # 3 usable blocks: each prompt fills one
    for rid, arrival in (("A", 1.0), ("B", 2.0)):
        params = SamplingParams(max_tokens=8)
        sched.add_request(Request(rid, [5, 6, 7, 8], sampling_params=params, arrival_time=arrival))
    first = sched.schedule()
    assert [s.request_id for s in first.scheduled] == ["A", "B"]
    second = sched.schedule()  # the first step still in flight: A takes the last free block
    assert second.preempted_request_ids == ["B"]
    assert [s.request_id for s in second.scheduled] == ["A"] and second.pending_rows == [0]
    outputs = sched.update_from_output(first, [11, 12])
    assert {o.request_id: o.new_token_ids for o in outputs} == {"A": [11], "B": [12]}
    b = next(r for r in sched.waiting if r.request_id == "B")
    assert b.status is RequestStatus.PREEMPTED and b.output_token_ids == [12]
