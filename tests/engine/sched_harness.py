"""Shared harness for the scheduler tests (``test_scheduler.py`` and ``test_sched_*.py``).

The scheduler is driven end to end against a simulated paged-KV runner. ``SlotRunner`` plays
the model runner on the real layout contract: every scheduled token is written into its slot
(``block_table[p // bs] * bs + p % bs``) together with its image embedding (looked up in the
runner's encoder store, which obeys the freed-hash reports), and sampling reads the whole
context back *through the block table*. The sampled token is a hash of that context, so a
shared block with the wrong content, a missing encoder output or a clobbered slot changes the
output, and every test compares outputs with a reference computed from the request's true
tokens.

Test modules import it after ``sys.path.insert`` of this folder (``--import-mode=importlib``).
"""

from __future__ import annotations

import hashlib

from mmis.engine.scheduling.request import Request
from mmis.engine.scheduling.sched_config import SchedulerConfig
from mmis.engine.scheduling.sched_output import MultiModalInput, ScheduledRequest, SchedulerOutput
from mmis.engine.scheduling.scheduler import Scheduler
from mmis.protocol.messages import (
    EngineCoreOutput,
    MultiModalFeature,
    PlaceholderRange,
    SamplingParams,
)

IMG = 7  # the placeholder token id
EOS = 2


def image(ident: str, offset: int, length: int) -> MultiModalFeature:
    return MultiModalFeature(
        modality="image", mm_hash=ident, placeholder=PlaceholderRange(offset, length)
    )


def make(
    rid: str,
    prompt: list[int],
    *features: MultiModalFeature,
    max_tokens: int = 4,
    arrival: float = 0.0,
    **params: object,
) -> Request:
    return Request(
        rid,
        prompt,
        mm_features=features,
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        arrival_time=arrival,
        eos_token_ids=(EOS,),
    )


def slot_value(token: int, pos: int, items: list[MultiModalInput], store: dict | None):
    """What slot ``pos`` holds; the reference (``store=None``) reads the item's own hash, the
    runner its encoder store."""
    for item in items:
        if item.offset <= pos < item.end:
            emb = item.mm_hash if store is None else store[item.mm_hash]
            return (token, emb, pos - item.offset)
    return (token, None, 0)


def next_token(context: list[tuple]) -> int:
    digest = hashlib.blake2b(repr(context).encode(), digest_size=4).digest()
    return 100 + int.from_bytes(digest, "big") % 100  # never EOS


def reference(prompt: list[int], features: list[MultiModalFeature], n: int) -> list[int]:
    items = [
        MultiModalInput(f.mm_hash, f.placeholder.offset, f.placeholder.length) for f in features
    ]
    tokens, out = list(prompt), []
    for _ in range(n):
        tok = next_token([slot_value(t, p, items, None) for p, t in enumerate(tokens)])
        out.append(tok)
        tokens.append(tok)
    return out


class EncoderMiss(AssertionError):
    pass


class SlotRunner:
    def __init__(self, block_size: int, script: dict[str, list[int]] | None = None) -> None:
        self.bs = block_size
        self.slots: dict[int, tuple] = {}
        self.written_at: dict[int, int] = {}  # slot -> step that wrote it
        self.encoder_store: dict[str, str] = {}
        self.encoded: list[tuple[int, str]] = []
        self.script = script or {}

    def execute(self, out: SchedulerOutput) -> list[int]:
        """One token per sampled chunk, in schedule order (``StepOutput.sampled``)."""
        for mm_hash in out.freed_encoder_hashes:
            if mm_hash not in self.encoder_store:
                raise AssertionError(f"freed {mm_hash} that the runner never held")
            del self.encoder_store[mm_hash]
        for item in out.scheduled:
            for idx in item.encoder_inputs:
                mm_hash = item.mm_items[idx].mm_hash
                self.encoder_store[mm_hash] = mm_hash
                self.encoded.append((out.step, mm_hash))
        sampled = []
        for item in out.scheduled:
            assert 0 not in item.block_table  # the null block is never handed out
            for pos in range(item.start_position):  # computed KV exists before the step
                slot = self._slot(item.block_table, pos)
                assert self.written_at.get(slot, out.step) < out.step, (item.request_id, pos)
        for item in out.scheduled:
            for j, token in enumerate(item.token_ids):
                pos = item.start_position + j
                try:
                    value = slot_value(token, pos, list(item.mm_items), self.encoder_store)
                except KeyError as exc:
                    raise EncoderMiss(f"{item.request_id}: no encoder output {exc}") from exc
                self.slots[self._slot(item.block_table, pos)] = value
                self.written_at[self._slot(item.block_table, pos)] = out.step
            if item.sample and item.pooling_params is None:  # a runner samples these
                end = item.start_position + len(item.token_ids)
                context = [self.slots[self._slot(item.block_table, p)] for p in range(end)]
                script = self.script.get(item.request_id)
                sampled.append(script.pop(0) if script else next_token(context))
        return sampled

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.bs] * self.bs + pos % self.bs


class Engine:
    """Scheduler + runner in the engine-core loop order: schedule, execute, update."""

    def __init__(self, script: dict[str, list[int]] | None = None, **cfg: object) -> None:
        self.sched = Scheduler(SchedulerConfig(**cfg))  # type: ignore[arg-type]
        self.runner = SlotRunner(self.sched.config.block_size, script)
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, EngineCoreOutput] = {}
        self.history: list[SchedulerOutput] = []

    def add(self, *requests: Request) -> None:
        for r in requests:
            self.sched.add_request(r)
            self.outputs[r.request_id] = []

    def step(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        out = self.sched.schedule()
        self.history.append(out)
        events = self.sched.update_from_output(out, self.runner.execute(out))
        for ev in events:
            self.outputs[ev.request_id].extend(ev.new_token_ids)
            if ev.finish_reason is not None:
                self.finished[ev.request_id] = ev
        return out, events

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests() and not self.sched.has_pending_outputs():
                return
            self.step()
        raise AssertionError("the scheduler did not drain")

    def assert_pool_empty(self) -> None:
        kv = self.sched.kv
        assert kv.num_free_blocks == kv.num_usable_blocks and kv.usage() == 0.0
        assert kv.req_blocks == {}
        assert self.sched.encoder_cache.num_freeable_slots == self.sched.encoder_cache.num_slots


def text(seed: int, n: int) -> list[int]:
    return [10 + (seed * 31 + i * 7) % 80 for i in range(n)]


def scheduled(out: SchedulerOutput, request_id: str) -> ScheduledRequest | None:
    """The work of ``request_id`` in ``out``, if it was scheduled."""
    return next((s for s in out.scheduled if s.request_id == request_id), None)
