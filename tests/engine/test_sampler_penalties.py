"""Logit bias, presence / frequency / repetition penalties and min-p: the batched sampler against
straightforward per-row references (transformers' own repetition-penalty processor, OpenAI's
formula written as a loop), the device token-count cache against ``bincount`` of the lists,
then the real engine core on the tiny models (greedy outputs move the expected way)."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from mmis.engine.execution.sampler import Sampler, needs_history
from mmis.engine.execution.token_history import TokenCounts, TokenHistoryCache
from mmis.engine.scheduling.sampling_params import SamplingParamsError, validate
from mmis.protocol.messages import EngineCoreRequest, SamplingParams

VOCAB = 40


@dataclasses.dataclass
class Hist:
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def _reference(logits: torch.Tensor, p: SamplingParams | None, hist: Hist | None) -> torch.Tensor:
    """One row, the slow obvious way: bias, then repetition (transformers), then OpenAI's
    ``mu[j] - c[j] * frequency - (c[j] > 0) * presence``."""
    row = logits.clone().double()
    if p is None:
        return row
    for token, bias in p.logit_bias.items():
        row[token] += bias
    if hist is None:
        return row
    if p.repetition_penalty != 1:
        ids = torch.tensor([hist.prompt_token_ids + hist.output_token_ids])
        row = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, row.unsqueeze(0))[0]
    counts = collections.Counter(hist.output_token_ids)
    for token, c in counts.items():
        row[token] -= c * p.frequency_penalty + p.presence_penalty
    return row


def _batch(
    params: list[SamplingParams | None], hists: list[Hist | None]
) -> tuple[torch.Tensor, TokenCounts | None]:
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    rows = [i for i, p in enumerate(params) if needs_history(p)]
    if not rows:
        return logits, None
    counts = TokenHistoryCache().counts(
        rows,
        [f"r{i}" for i in rows],
        [hists[i] for i in rows],  # type: ignore[misc]
        with_prompt=any(params[i].repetition_penalty != 1 for i in rows),  # type: ignore[union-attr]
        vocab_size=VOCAB,
        device=logits.device,
    )
    return logits, counts


MIXED_PARAMS: list[SamplingParams | None] = [
    None,
    SamplingParams(temperature=0.0, frequency_penalty=0.7),
    SamplingParams(temperature=0.0, presence_penalty=-1.5, logit_bias={3: 4.0, 39: -2.5}),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.8),
    SamplingParams(temperature=0.0, repetition_penalty=0.6, frequency_penalty=2.0),
    SamplingParams(temperature=0.0, logit_bias={5: 100.0}),
]
MIXED_HISTS: list[Hist | None] = [
    Hist([1, 2], [3]),
    Hist([4, 5, 6], [7, 7, 7, 8, 1]),
    Hist([9], [3, 3, 10, 11]),
    None,
    Hist([12, 13, 14, 15, 16], [17, 12, 18]),
    Hist([0, 19, 20, 21], [20, 22, 22, 23, 24]),
    None,
]


def test_adjusted_logits_match_the_reference_row_by_row():
    logits, counts = _batch(MIXED_PARAMS, MIXED_HISTS)
    got = Sampler._bias_and_penalize(logits.float(), MIXED_PARAMS, counts)
    for i, (p, h) in enumerate(zip(MIXED_PARAMS, MIXED_HISTS, strict=True)):
        want = _reference(logits[i], p, h if needs_history(p) else None)
        torch.testing.assert_close(got[i].double(), want, rtol=1e-6, atol=1e-5)
    # the comparison has teeth: every adjusted row really moved
    for i in (1, 2, 4, 5, 6):
        assert not torch.allclose(got[i], logits[i]), i
    torch.testing.assert_close(got[0], logits[0])  # untouched rows stay as they were
    torch.testing.assert_close(got[3], logits[3])


def test_greedy_with_penalties_is_the_argmax_of_the_reference_and_deterministic():
    logits, counts = _batch(MIXED_PARAMS, MIXED_HISTS)
    first = Sampler()(logits, MIXED_PARAMS, [9] * len(MIXED_PARAMS), counts)
    again = Sampler()(logits, MIXED_PARAMS, [9] * len(MIXED_PARAMS), counts)
    assert torch.equal(first, again)
    for i, (p, h) in enumerate(zip(MIXED_PARAMS, MIXED_HISTS, strict=True)):
        assert first[i] == _reference(logits[i], p, h if needs_history(p) else None).argmax()
    assert first[6] == 5  # +100 forces the token


def test_each_penalty_changes_the_greedy_pick_in_its_direction():
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 8], logits[0, 9] = 3.0, 2.5, 2.0  # 7 best, already output twice
    hist = Hist([9], [7, 7])

    def pick(p: SamplingParams) -> int:
        counts = TokenHistoryCache().counts(
            [0], ["r"], [hist], with_prompt=True, vocab_size=VOCAB, device=logits.device
        )
        return int(Sampler()(logits, [p], [3], counts if needs_history(p) else None)[0])

    assert pick(SamplingParams(temperature=0.0)) == 7
    assert pick(SamplingParams(temperature=0.0, frequency_penalty=0.3)) == 8  # 3 - 0.6 < 2.5
    assert pick(SamplingParams(temperature=0.0, frequency_penalty=0.2)) == 7  # 3 - 0.4 > 2.5
    assert pick(SamplingParams(temperature=0.0, presence_penalty=0.6)) == 8  # once, not twice
    assert pick(SamplingParams(temperature=0.0, presence_penalty=0.4)) == 7
    assert pick(SamplingParams(temperature=0.0, presence_penalty=-2.0)) == 7
    assert pick(SamplingParams(temperature=0.0, repetition_penalty=1.3)) == 8  # 7 and 9 seen
    assert pick(SamplingParams(temperature=0.0, repetition_penalty=2.0)) == 8  # 9: 1.0 < 2.5
    assert pick(SamplingParams(temperature=0.0, logit_bias={9: 1.1})) == 9
    assert pick(SamplingParams(temperature=0.0, logit_bias={7: -100.0})) == 8


def test_negative_logits_are_multiplied_by_the_repetition_penalty():
    logits = torch.tensor([[-1.0, -1.5, -3.0] + [-9.0] * (VOCAB - 3)])
    counts = TokenHistoryCache().counts(
        [0], ["r"], [Hist([0], [])], with_prompt=True, vocab_size=VOCAB, device=logits.device
    )
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    out = Sampler._bias_and_penalize(logits, [p], counts)
    assert out[0, 0] == -2.0 and out[0, 1] == -1.5  # a prompt token, multiplied
    assert Sampler()(logits, [p], [1], counts)[0] == 1


def test_token_history_cache_counts_equal_the_lists_as_they_grow():
    cache = TokenHistoryCache()
    hists = {"a": Hist([1, 2, 2], []), "b": Hist([3], [4, 4, 5]), "c": Hist([6, 7], [7])}
    gen = torch.Generator().manual_seed(0)

    def check(ids: list[str], with_prompt: bool = True) -> None:
        got = cache.counts(
            list(range(len(ids))),
            ids,
            [hists[i] for i in ids],
            with_prompt=with_prompt,
            vocab_size=VOCAB,
            device=torch.device("cpu"),
        )
        for k, rid in enumerate(ids):
            tokens = torch.tensor(hists[rid].output_token_ids, dtype=torch.long)
            want = torch.bincount(tokens, minlength=VOCAB).float()
            assert torch.equal(got.output[k], want), (rid, got.output[k], want)
            if not with_prompt:
                assert got.prompt is None
                continue
            assert got.prompt is not None
            mask = torch.zeros(VOCAB, dtype=torch.bool)
            mask[hists[rid].prompt_token_ids] = True
            assert torch.equal(got.prompt[k], mask)

    check(["a", "b"])
    batches = [["a", "b", "c"], ["a", "b", "c"], ["c", "a"], ["c", "a"], ["b"], ["b", "c", "a"]]
    for step in range(18):  # append, keep or change the batch, drop and re-admit
        for h in hists.values():
            new = torch.randint(0, VOCAB, (1 + step % 2,), generator=gen).tolist()
            h.output_token_ids.extend(new)
        if step in (5, 11):
            cache.drop(["a"])
        check(batches[step % len(batches)], with_prompt=step % 4 != 1)
    assert len(cache) == 3


def test_min_p_keeps_only_tokens_near_the_best():
    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0, 1.5, 0.0]])  # probs: 1 .43, 4 .26, 2 .16
    rows = 4000
    many = logits.expand(rows, 6).clone()
    p = SamplingParams(temperature=1.0, min_p=0.5, seed=4)  # keeps p >= .215: tokens 1 and 4
    seen = collections.Counter(Sampler()(many, [p] * rows, list(range(rows))).tolist())
    assert set(seen) == {1, 4}
    ratio = seen[1] / seen[4]
    assert 1.45 < ratio < 1.85  # renormalised, not flattened: e^(2.0-1.5) = 1.65
    loose = SamplingParams(temperature=1.0, min_p=0.0, seed=4)
    assert len(set(Sampler()(many, [loose] * rows, list(range(rows))).tolist())) == 6


def test_logit_bias_bans_and_forces_in_sampling_too():
    rows = 2000
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(2))
    forced = SamplingParams(temperature=1.0, logit_bias={11: 100.0})
    assert set(Sampler()(logits, [forced] * rows, [0] * rows).tolist()) == {11}
    best = int(logits[0].argmax())
    banned = SamplingParams(temperature=0.7, logit_bias={best: -100.0})
    assert best not in Sampler()(logits[:1].expand(rows, VOCAB), [banned] * rows, [0] * rows)


def test_seeded_row_with_penalties_is_the_same_alone_and_in_a_crowd():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5))
    hist = Hist([1, 2, 3], [4, 4, 5, 6, 4])
    seeded = SamplingParams(temperature=1.0, seed=9, frequency_penalty=1.0, repetition_penalty=1.2)

    def alone(position: int) -> int:
        counts = TokenHistoryCache().counts(
            [0], ["s"], [hist], with_prompt=True, vocab_size=VOCAB, device=logits.device
        )
        return int(Sampler()(logits, [seeded], [position], counts)[0])

    crowd_params = [SamplingParams(presence_penalty=2.0), seeded, None, SamplingParams(seed=1)]
    crowd_logits = torch.cat([torch.randn(1, VOCAB), logits, torch.randn(2, VOCAB)])
    counts = TokenHistoryCache().counts(
        [0, 1],
        ["n", "s"],
        [Hist([7], [8, 9]), hist],
        with_prompt=True,
        vocab_size=VOCAB,
        device=logits.device,
    )
    for position in (8, 9, 10):
        in_crowd = Sampler()(crowd_logits, crowd_params, [3, position, 3, 3], counts)
        assert int(in_crowd[1]) == alone(position)
    assert len({alone(pos) for pos in range(8, 40)}) > 1  # it really samples


def test_the_fast_path_runs_no_adjustment(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the fast path must not adjust logits")

    monkeypatch.setattr(Sampler, "_bias_and_penalize", staticmethod(boom))
    logits = torch.randn(3, VOCAB)
    params = [None, SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1)]
    Sampler()(logits, params, [0, 0, 0])
    with pytest.raises(AssertionError, match="fast path"):
        Sampler()(logits[:1], [SamplingParams(logit_bias={1: 1.0})], [0])
    monkeypatch.undo()
    assert Sampler()(logits[:1], [SamplingParams(min_p=0.1)], [0]).shape == (1,)


def test_penalties_without_a_history_are_a_typed_error():
    with pytest.raises(SamplingParamsError, match="token history"):
        Sampler()(torch.randn(1, VOCAB), [SamplingParams(frequency_penalty=1.0)], [0])


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (SamplingParams(presence_penalty=float("nan")), "presence_penalty"),
        (SamplingParams(frequency_penalty=-2.01), "frequency_penalty"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(repetition_penalty=float("inf")), "repetition_penalty"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(min_p=-0.1), "min_p"),
        (SamplingParams(logit_bias={1: 100.5}), "logit_bias"),
        (SamplingParams(logit_bias={-1: 1.0}), "logit_bias"),
        (SamplingParams(logit_bias={VOCAB: 1.0}), "logit_bias"),
        (SamplingParams(logit_bias=dict.fromkeys(range(301), 1.0)), "logit_bias"),
        (SamplingParams(temperature=float("nan")), "temperature"),
    ],
)
def test_out_of_range_values_are_typed_errors_naming_the_field(params, field):
    with pytest.raises(SamplingParamsError, match=f"^{field}") as info:
        validate(params, VOCAB)
    assert info.value.to_wire().code == "invalid_request"
    if all(abs(v) <= 100 for v in params.logit_bias.values()):  # bias values: admission only
        with pytest.raises(SamplingParamsError, match=f"^{field}"):
            Sampler()(torch.randn(1, VOCAB), [params], [0], None)


def test_in_range_edges_are_accepted():
    validate(
        SamplingParams(
            presence_penalty=-2.0,
            frequency_penalty=2.0,
            repetition_penalty=1e-3,
            min_p=1.0,
            logit_bias={0: -100.0, VOCAB - 1: 100.0},
        ),
        VOCAB,
    )


# -- the real engine core on the tiny models -------------------------------------------------


@pytest.fixture
def core_run(family):
    from mmis.engine.builder import make_core
    from mmis.engine.config import EngineConfig

    runner = family.runner()
    ids, _, _ = family.request("The quick brown fox jumps over the lazy dog.", [])

    def run(*params: SamplingParams, max_tokens: int = 40) -> list[list[int]]:
        core = make_core(EngineConfig(), runner)
        for k, p in enumerate(params):
            p.max_tokens, p.ignore_eos = max_tokens, True
            core.add_request(EngineCoreRequest(f"r{k}", list(ids), sampling_params=p))
        tokens: dict[str, list[int]] = {f"r{k}": [] for k in range(len(params))}
        errors = {}
        while core.has_work():
            for out in core.step():
                tokens[out.request_id] += out.new_token_ids
                if out.error is not None:
                    errors[out.request_id] = out.error
        if errors:
            raise AssertionError(errors)
        return [tokens[f"r{k}"] for k in range(len(params))]

    run.prompt = ids  # type: ignore[attr-defined]
    run.core = lambda: make_core(EngineConfig(), runner)  # type: ignore[attr-defined]
    return run


def _greedy(**kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)  # type: ignore[arg-type]


def _first_repeat(tokens: list[int]) -> int:
    seen: set[int] = set()
    for i, t in enumerate(tokens):
        if t in seen:
            return i
        seen.add(t)
    return len(tokens)


@pytest.mark.model
def test_engine_penalties_move_the_greedy_output_of_the_tiny_model(family, core_run):
    (base,) = core_run(_greedy())
    assert _first_repeat(base) < len(base)  # the tiny model repeats itself: the test has teeth
    (freq,) = core_run(_greedy(frequency_penalty=2.0))
    (pres,) = core_run(_greedy(presence_penalty=2.0))
    (rep,) = core_run(_greedy(repetition_penalty=5.0))
    (forced,) = core_run(_greedy(logit_bias={7: 100.0}))
    (banned,) = core_run(_greedy(logit_bias={base[0]: -100.0}))
    # until the base output repeats a token, output penalties change nothing ...
    cut = _first_repeat(base)
    assert freq[:cut] == base[:cut] and pres[:cut] == base[:cut]
    # ... and then they keep every token from recurring (the penalty outweighs the margins)
    assert _first_repeat(freq) == len(freq) and _first_repeat(pres) == len(pres)
    # the repetition penalty also covers the prompt
    assert _first_repeat(rep) == len(rep) and not set(rep) & set(core_run.prompt)
    assert forced == [7] * len(forced)
    assert banned[0] != base[0] and base[0] not in banned
    # deterministic, and independent of the batch: all of them at once give the same
    together = core_run(
        _greedy(),
        _greedy(frequency_penalty=2.0),
        _greedy(repetition_penalty=5.0),
        _greedy(logit_bias={7: 100.0}),
    )
    assert together == [base, freq, rep, forced]


@pytest.mark.model
def test_engine_seeded_sampling_with_penalties_is_reproducible(family, core_run):
    def seeded(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=seed, frequency_penalty=1.5, min_p=0.02)

    (alone,) = core_run(seeded(5))
    with_neighbour = core_run(SamplingParams(temperature=1.2, presence_penalty=1.0), seeded(5))
    assert with_neighbour[1] == alone
    assert core_run(seeded(6))[0] != alone


@pytest.mark.model
def test_engine_refuses_a_logit_bias_token_outside_the_vocabulary(family, core_run):
    core = core_run.core()
    vocab = core.vocab_size
    bad = SamplingParams(logit_bias={vocab: 1.0})
    core.add_request(EngineCoreRequest("bad", [1, 2, 3], sampling_params=bad))
    (out,) = core.step()
    assert out.finish_reason == "error" and out.error is not None
    assert out.error.code == "invalid_request"
    assert out.error.message.startswith("logit_bias") and str(vocab) in out.error.message
    assert not core.scheduler.requests
