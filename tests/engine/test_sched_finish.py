"""Scheduler: how a request finishes.

Stop conditions are applied without a tokenizer (EOS, stop token ids, ``ignore_eos``, a stop
string reported by the caller), ``max_model_len`` caps generation and rejects prompts that
cannot fit, and pooling requests finish right after their prefill.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sched_harness import EOS, Engine, make, text

from mmis.engine.scheduling.request import Request
from mmis.protocol.messages import ErrorCode, FinishReason


def test_stop_conditions_without_a_tokenizer():
    script = {"eos": [150, EOS, 151], "stopid": [150, 42, 151], "ignore": [EOS, EOS, 160]}
    eng = Engine(script=script, block_size=4, num_blocks=64)
    eng.add(
        make("eos", text(1, 5), max_tokens=10),
        make("stopid", text(2, 5), max_tokens=10, stop_token_ids=[42]),
        make("ignore", text(3, 5), max_tokens=3, ignore_eos=True),
        make("strings", text(4, 5), max_tokens=10),
    )
    eng.step()
    eng.step()
    # the caller (who has the tokenizer) saw a stop string in "strings"
    assert eng.sched.finish_request("strings", FinishReason.STOP, stop_reason="###")
    eng.run()
    fin = eng.finished
    assert eng.outputs["eos"] == [150, EOS] and fin["eos"].finish_reason == FinishReason.STOP
    assert eng.outputs["stopid"] == [150, 42] and fin["stopid"].stop_reason == 42
    assert eng.outputs["ignore"] == [EOS, EOS, 160]
    assert fin["ignore"].finish_reason == FinishReason.LENGTH
    assert len(eng.outputs["strings"]) == 2 and "strings" not in fin
    eng.assert_pool_empty()


def test_max_model_len_stops_generation_and_rejects_long_prompts():
    eng = Engine(block_size=4, num_blocks=64, max_model_len=12)
    eng.add(make("fits", text(1, 8), max_tokens=50), make("long", text(2, 12)))
    eng.run()
    assert len(eng.outputs["fits"]) == 4
    assert eng.finished["fits"].finish_reason == FinishReason.LENGTH
    err = eng.finished["long"].error
    assert err is not None and err.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED.value


def test_pooling_requests_finish_after_prefill():
    from mmis.protocol.messages import PoolingParams

    eng = Engine(block_size=4, num_blocks=16)
    eng.add(Request("emb", text(1, 9), pooling_params=PoolingParams()))
    out, events = eng.step()
    assert out.scheduled[0].sample and out.scheduled[0].pooling_params is not None
    assert events[0].finish_reason is not None and events[0].new_token_ids == []
    eng.assert_pool_empty()
