"""The grammar engine (``engine/execution/structured.py``) on the tiny model's real tokenizer: masks
that
only let the grammar's tokens through (so random logits still give schema-valid JSON), the
bounded compile cache, compile errors naming the parameter, and the request's stop/violation
handling (``engine/scheduling/request.py``)."""

from __future__ import annotations

import json
import re

import jsonschema_rs
import pytest
import torch
from transformers import AutoTokenizer

from mmis.engine.execution.sampler import Sampler
from mmis.engine.execution.structured import (
    WORKER_MIN_SECONDS,
    GrammarEngine,
    StructuredOutputError,
)
from mmis.engine.scheduling.request import Request
from mmis.protocol.messages import FinishReason, SamplingParams, StructuredOutputs
from mmis.tiny_models.tiny_model import tiny_model_dir

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(tiny_model_dir())


@pytest.fixture(scope="module")
def engine(tokenizer) -> GrammarEngine:  # type: ignore[no-untyped-def]
    return GrammarEngine.from_model_dir(
        tiny_model_dir(), vocab_size=len(tokenizer), eos_token_ids=[tokenizer.eos_token_id]
    )


def _params(kind: str, spec: str = "", **kw: object) -> SamplingParams:
    return SamplingParams(structured=StructuredOutputs(kind, spec, "response_format"), **kw)  # type: ignore[arg-type]


def _walk(engine: GrammarEngine, tokenizer, params: SamplingParams, seed: int, limit: int = 200):  # type: ignore[no-untyped-def]
    """Sample from random logits under the grammar until it ends: (text, ended)."""
    state = engine.start(params)
    sampler = Sampler(engine)
    gen = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    for position in range(limit):
        logits = torch.randn(1, engine.vocab_size, generator=gen) * 4
        (token,) = sampler(logits, [params], [position]).tolist()
        assert state.accept(token), f"the mask let token {token} through"
        tokens.append(token)
        if state.is_done():
            break
    assert tokens[-1] == tokenizer.eos_token_id or not state.is_done()
    return tokenizer.decode(tokens, skip_special_tokens=True), state.is_done()


def test_random_logits_under_a_schema_always_give_valid_json(engine, tokenizer) -> None:
    validator = jsonschema_rs.validator_for(SCHEMA)
    params = _params("json", json.dumps(SCHEMA), temperature=1.0)
    for seed in range(6):
        text, ended = _walk(engine, tokenizer, params, seed)
        assert ended, text
        value = json.loads(text)  # strict: no raw control characters in strings either
        assert validator.is_valid(value), (text, list(validator.iter_errors(value)))


def test_json_object_regex_choice_and_grammar(engine, tokenizer) -> None:
    text, ended = _walk(engine, tokenizer, _params("regex", "[0-9]{3}-[a-z]{2}"), 1)
    assert ended and re.fullmatch("[0-9]{3}-[a-z]{2}", text), text
    options = ["yes", "no", "maybe so"]
    picks = {
        _walk(engine, tokenizer, _params("choice", json.dumps(options)), s)[0] for s in range(8)
    }
    assert picks <= set(options) and len(picks) > 1
    text, ended = _walk(engine, tokenizer, _params("grammar", 'root ::= "a" [0-9] "b"'), 2)
    assert ended and re.fullmatch("a[0-9]b", text)
    text, _ = _walk(engine, tokenizer, _params("json_object"), 3, limit=30)
    assert text.startswith("{")


def test_unconstrained_rows_are_untouched_and_constrained_rows_masked(engine) -> None:
    constrained = _params("regex", "[0-9]+")
    state = engine.start(constrained)  # the request owns it; the engine holds it weakly
    logits = torch.randn(3, engine.vocab_size)
    before = logits.clone()
    out = engine.apply(logits, [None, constrained, SamplingParams()])
    assert torch.equal(out[0], before[0]) and torch.equal(out[2], before[2])
    allowed = torch.isfinite(out[1]).nonzero().view(-1).tolist()
    assert 0 < len(allowed) < engine.vocab_size
    del state
    with pytest.raises(StructuredOutputError):  # gone with its request
        engine.apply(logits, [constrained])


def test_a_constrained_row_without_grammar_engine_is_an_error(engine) -> None:
    with pytest.raises(ValueError, match="grammar engine"):
        Sampler()(torch.zeros(1, engine.vocab_size), [_params("regex", "x")], [0])


def test_grammars_are_compiled_once_and_the_cache_is_bounded(tokenizer) -> None:
    small = GrammarEngine.from_model_dir(
        tiny_model_dir(), vocab_size=len(tokenizer), eos_token_ids=[2], cache_size=2
    )
    for _ in range(3):
        small.start(_params("regex", "a+"))
    assert (small.num_compiled, small.num_cache_hits) == (1, 2)
    small.start(_params("regex", "b+"))
    small.start(_params("regex", "c+"))  # evicts a+
    small.start(_params("regex", "a+"))
    assert small.num_compiled == 4 and small.stats()["grammars_cached"] == 2


@pytest.mark.parametrize(
    ("kind", "spec", "needle"),
    [
        ("json", '{"type": "foo"}', "foo"),
        ("regex", "(ab", "parenthesis"),
        ("grammar", "root ::= ", "grammar"),
        ("choice", "[]", "choice"),
        ("xml", "", "unknown constraint kind"),
    ],
)
def test_a_spec_that_does_not_compile_names_the_param(engine, kind, spec, needle) -> None:
    with pytest.raises(StructuredOutputError) as info:
        engine.start(_params(kind, spec))
    assert info.value.param == "response_format" and info.value.code == "invalid_request"
    message = str(info.value)
    assert message.startswith("response_format: ") and needle in message
    assert ".cc:" not in message  # no C++ source locations for the client


def test_the_request_stops_when_the_grammar_ends(engine, tokenizer) -> None:
    params = _params("choice", '["ab"]', max_tokens=50, ignore_eos=True)
    state = engine.start(params)
    request = Request("r", [1, 2], sampling_params=params, constraint=state, eos_token_ids=[7])
    for token in tokenizer("ab", add_special_tokens=False)["input_ids"]:
        request.append_output_token_ids([token])
        assert not request.check_stop(token)
    request.append_output_token_ids([tokenizer.eos_token_id])
    assert request.check_stop(tokenizer.eos_token_id)  # ignore_eos: the grammar's end stops it
    assert request.finish_reason is FinishReason.STOP
    bad = _params("choice", '["ab"]')
    wrong = Request("w", [1], sampling_params=bad, constraint=engine.start(bad))
    token = tokenizer("zz", add_special_tokens=False)["input_ids"][0]
    wrong.append_output_token_ids([token])  # refused on the accept worker: known one token later
    assert not wrong.check_stop(token)
    engine.worker_min_seconds = 0.0  # on the worker thread
    engine.flush()
    engine.settle()
    engine.worker_min_seconds = WORKER_MIN_SECONDS
    assert engine.stats()["grammar_tokens_refused"] >= 1
    wrong.append_output_token_ids([token])
    assert wrong.check_stop(token) and wrong.finish_reason is FinishReason.ERROR


def test_pushed_tokens_accepted_on_the_worker_give_the_masks_of_accepting_now(
    engine, tokenizer
) -> None:
    """The core's path (push, flush after the update, the sampler's apply settles) walks the
    grammar exactly as accepting each token at once does, step by step, across a batch. The
    random walk needs room to close the JSON object: 60 steps were enough for the tiny
    vocabulary before 175ab29 took its control-byte tokens out, not after."""
    steps = 160
    engine.worker_min_seconds = 0.0  # every step's accepts on the worker thread
    specs = [("regex", "[a-z ]{40,}"), ("json", json.dumps(SCHEMA)), ("choice", '["ab", "cd"]')]
    gen = torch.Generator().manual_seed(3)
    pushed, now, requests = [], [], []
    for n, (kind, spec) in enumerate(specs):
        p, q = _params(kind, spec, max_tokens=steps), _params(kind, spec)
        state = engine.start(p)
        pushed.append(p)
        now.append((q, engine.start(q)))
        requests.append(Request(f"r{n}", [1], sampling_params=p, constraint=state))
    for _step in range(steps):
        live = [i for i, r in enumerate(requests) if not r.is_finished]
        if not live:
            break
        logits = torch.randn(len(live), engine.vocab_size, generator=gen) * 4
        masked = engine.apply(logits.clone(), [pushed[i] for i in live])
        expected = engine.apply(logits.clone(), [now[i][0] for i in live])
        assert torch.equal(masked.isinf(), expected.isinf())
        for row, i in enumerate(live):
            token = int(masked[row].argmax())
            assert now[i][1].accept(token)
            requests[i].append_output_token_ids([token])
            requests[i].check_stop(token)
            assert requests[i].constraint.is_done() == now[i][1].is_done()
        engine.flush()  # the worker accepts while the next step's logits are made
    engine.worker_min_seconds = WORKER_MIN_SECONDS
    assert all(r.finish_reason is FinishReason.STOP for r in requests[1:])  # the regex runs on


def _byte_token(tokenizer, byte: int) -> int:  # type: ignore[no-untyped-def]
    """The id of the byte-level BPE token of one raw byte (GPT-2's byte -> char map)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in printable}
    extra = iter(range(256, 512))
    chars |= {b: chr(next(extra)) for b in range(256) if b not in chars}
    return int(tokenizer.convert_tokens_to_ids(chars[byte]))


@pytest.mark.parametrize(
    ("kind", "spec", "prefix"),
    [
        ("json", '{"type": "string", "maxLength": 8}', '"'),
        ("json", '{"type": "string"}', '"'),
        ("json_object", "", '{"'),
        ("regex", ".{0,8}", ""),
    ],
)
def test_strings_hold_valid_utf8_only(engine, tokenizer, kind, spec, prefix) -> None:
    """ED 9F BF is U+D7FF; ED A0 80 would be a UTF-16 surrogate (not UTF-8); 0x0A a raw
    control character (not JSON; the tiny vocabulary keeps tab and newline of the control
    bytes, tiny_tokenizer.CONTROL_CHARS)."""
    lead, low, high, cont = (_byte_token(tokenizer, b) for b in (0xED, 0x9F, 0xA0, 0xBF))

    def started():  # type: ignore[no-untyped-def]
        params = _params(kind, spec)  # one params object per state, as the core makes them
        state = engine.start(params)
        for token in tokenizer(prefix, add_special_tokens=False)["input_ids"] if prefix else []:
            assert state.accept(token)
        return params, state

    def mask(params):  # type: ignore[no-untyped-def]
        return engine.apply(torch.zeros(1, engine.vocab_size), [params])[0]

    _kept, ok = started()  # (the engine holds states weakly: keep its params)
    assert ok.accept(lead) and ok.accept(low) and ok.accept(cont)  # U+D7FF is fine
    params, state = started()
    assert mask(params)[lead] == 0 and state.accept(lead)
    assert mask(params)[high] == float("-inf") and mask(params)[low] == 0
    assert not state.accept(high)
    if kind != "regex":
        params, state = started()
        assert mask(params)[_byte_token(tokenizer, 0x0A)] == float("-inf")


def test_the_batched_mask_matches_one_fill_per_row_on_every_path(engine, tokenizer) -> None:
    """``apply`` fills all constrained rows in one call and masks with xgrammar's CPU kernel
    (or the torch unpack off the CPU): the same ``-inf`` set as one matcher fill per row, for
    a mixed batch whose logits are wider than the grammar's vocabulary."""
    import xgrammar as xgr

    prefixes = ['{"name": "', '{"name": "ab", "age": 1', ""]
    kept, params = [], []
    for k, prefix in enumerate(prefixes):
        params.append(SamplingParams() if k == 1 else None)  # unconstrained rows in between
        p = _params("json", json.dumps(SCHEMA))
        state = engine.start(p)
        for token in tokenizer(prefix, add_special_tokens=False)["input_ids"] if prefix else []:
            assert state.accept(token)
        kept.append(state)
        params.append(p)
    rows = [i for i, p in enumerate(params) if p is not None and p.structured is not None]
    width = engine.vocab_size + 7
    logits = torch.randn(len(params), width, generator=torch.Generator().manual_seed(0))
    expected = logits.clone()
    one = xgr.allocate_token_bitmask(1, engine.vocab_size)
    for row, state in zip(rows, kept, strict=True):
        state.fill(one, 0)
        bits = [(int(one[0, t // 32]) >> (t % 32)) & 1 for t in range(engine.vocab_size)]
        allowed = torch.tensor(bits + [0] * 7, dtype=torch.bool)
        assert 0 < int(allowed.sum()) < engine.vocab_size
        expected[row] = expected[row].masked_fill(~allowed, float("-inf"))
    assert torch.equal(engine.apply(logits.clone(), params), expected)
    bitmask = engine._bitmask[: len(params)]  # the device-generic path, on the same masks
    unpacked = engine._apply_unpacked(logits.clone(), bitmask, rows, engine.vocab_size)
    assert torch.equal(unpacked, expected)
