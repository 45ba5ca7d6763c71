"""Multi-LoRA cache exactness in the scheduler (issue 47): the real scheduler, KV cache and
encoder cache over the simulated runner of ``sched_harness.py``.

- The same prompt and image under two adapters share no prefix-cache block (counted: no hit,
  every block allocated anew); under one adapter they do.
- The encoder output is keyed by the adapter only when the adapter changes the vision tower:
  two tower adapters encode the image twice; an adapter of the language model alone reuses the
  base's encoder output (its blocks are still its own).
- KV events carry the adapter's ``lora_id`` / ``lora_name`` (vLLM's fields); base: None.
- At most ``max_loras`` distinct adapters run at once.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mmis.engine.kv_events import KVEventLog
from mmis.engine.scheduling.request import Request
from mmis.protocol.kv_events import BlockStored
from mmis.protocol.messages import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sched_harness import EOS, IMG, Engine, image, scheduled, text

PROMPT = [*text(3, 8), *[IMG] * 8, *text(4, 16)]  # image at [8, 16), 32 tokens: 8 blocks of 4


def _req(rid: str, lora: tuple[str, int] | None = None, tower: bool = False) -> Request:
    name, lora_id = lora if lora is not None else (None, 0)
    return Request(
        rid,
        PROMPT,
        mm_features=[image("img", 8, 8)],
        sampling_params=SamplingParams(max_tokens=2),
        eos_token_ids=(EOS,),
        lora_name=name,
        lora_id=lora_id,
        lora_tower=tower,
    )


def _first_start(eng: Engine, request: Request) -> int:
    """Run ``request`` alone after what ran before; the tokens its prefix hit skipped."""
    eng.add(request)
    out, _ = eng.step()
    row = scheduled(out, request.request_id)
    assert row is not None
    eng.run()
    return row.start_position


def _encodes(eng: Engine) -> int:
    return len(eng.runner.encoded)


def test_two_adapters_share_no_blocks_and_one_adapter_does() -> None:
    eng = Engine(block_size=4, num_blocks=64)
    assert _first_start(eng, _req("a1", ("a", 1), tower=True)) == 0
    assert _first_start(eng, _req("b1", ("b", 2), tower=True)) == 0  # another adapter: no hit
    assert _first_start(eng, _req("base", None)) == 0  # nor the base model
    assert _first_start(eng, _req("a2", ("a", 1), tower=True)) == 28  # one adapter: shared
    assert _first_start(eng, _req("base2", None)) == 28
    stats = eng.sched.stats()
    assert stats.prefix_cache_hits == 2 * 28  # counted: only the two same-adapter repeats
    assert eng.outputs["a1"] == eng.outputs["a2"]


def test_encoder_output_is_keyed_by_the_adapter_only_when_it_changes_the_tower() -> None:
    eng = Engine(block_size=4, num_blocks=64)
    _first_start(eng, _req("t1", ("t1", 1), tower=True))
    _first_start(eng, _req("t2", ("t2", 2), tower=True))
    assert _encodes(eng) == 2  # two tower adapters: the image encoded under each
    _first_start(eng, _req("base", None))
    assert _encodes(eng) == 3  # the base tower: a third output
    assert _first_start(eng, _req("lm", ("lm", 3), tower=False)) == 0  # blocks: its own
    assert _encodes(eng) == 3  # the language-model-only adapter reuses the base's output
    keys = {key for _, key in eng.runner.encoded}
    assert keys == {"img+lora1", "img+lora2", "img"}


def test_kv_events_carry_the_adapter() -> None:
    eng = Engine(block_size=4, num_blocks=64)
    eng.sched.kv.pool.events = log = KVEventLog(block_size=4)
    _first_start(eng, _req("a", ("tenant-a", 5), tower=True))
    _first_start(eng, _req("base", None))
    stored = [e for e in log.drain() if isinstance(e, BlockStored)]
    assert {(e.lora_id, e.lora_name) for e in stored} == {(5, "tenant-a"), (None, None)}
    by_adapter = {e.lora_id: set(e.block_hashes) for e in stored}
    assert not by_adapter[5] & by_adapter[None]


def test_at_most_max_loras_distinct_adapters_run_at_once() -> None:
    eng = Engine(block_size=4, num_blocks=64, max_loras=2)
    eng.add(_req("a", ("a", 1)), _req("b", ("b", 2)), _req("c", ("c", 3)), _req("a2", ("a", 1)))
    out, _ = eng.step()
    assert [s.request_id for s in out.scheduled] == ["a", "b"]  # c waits, and FCFS a2 too
    eng.run()
    assert all(eng.outputs[r] for r in "abc") and eng.outputs["a2"]
    for out in eng.history:
        assert len({s.lora_name for s in out.scheduled} - {None}) <= 2
