"""``--cpu-linear`` (``server/mmis/engine/execution/cpu_linear.py``): oneDNN's prepacked linears.

A packed module must compute what the linear did, in float32, bfloat16 and float16, for the input
shapes the model feeds it; packing a real transformers model must leave its greedy answer and
its logits as they were, touch the decoder layers and the LM head only, and drop the unpacked
weights; the measurement is torch's summed best time over oneDNN's, every measured row count
timed (pinned under a fake clock); ``auto`` packs exactly the shapes it says are faster; a
oneDNN that cannot run leaves every module as it was. The engine-process tests run packed
throughout (``tests/conftest.py``); one of them reads the start-up log line here.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mmis.engine.execution import cpu_linear, timing
from mmis.engine.execution.cpu_linear import PackedLinear, pack_adapter, pack_linears
from mmis.engine.execution.model import load_adapter
from mmis.protocol.messages import EngineCoreRequest, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_harness import EngineHarness


def _linear(n_in: int, n_out: int, dtype: torch.dtype, bias: bool) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(n_in, n_out, bias=bias).to(dtype).requires_grad_(False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_linear_computes_what_the_linear_did(dtype: torch.dtype, bias: bool) -> None:
    linear = _linear(96, 300, dtype, bias)
    if not cpu_linear.onednn_supports(dtype):  # e.g. 16-bit floats on an AVX2-only CPU
        with pytest.raises(RuntimeError):
            PackedLinear(linear)  # oneDNN itself refuses: the check below is not too strict
        model = torch.nn.Sequential(torch.nn.Sequential(linear))
        report = pack_linears(model, model[0], "onednn")
        assert (report.packed, report.kept) == (0, 1) and model[0][0] is linear
        why = f"no {str(dtype).removeprefix('torch.')} path on this CPU"
        assert report.describe() == f"torch for all 1 (oneDNN unusable: {why})"
        return
    packed = PackedLinear(linear)
    inputs = [
        torch.randn(5, 96),  # packed rows of a step
        torch.randn(2, 7, 96),  # [batch, tokens, hidden], as transformers calls it
        torch.randn(96, 14).t(),  # a transposed view
        torch.randn(3, 5, 96).transpose(0, 1),  # a non-contiguous 3-D view
        torch.randn(0, 96),  # no rows
    ]
    tolerance = {torch.float32: 1e-4, torch.float16: 0.02}.get(dtype, 0.1)
    with torch.inference_mode():
        for x in inputs:
            x = x.to(dtype)
            got, want = packed(x), linear(x)
            assert got.shape == want.shape and got.dtype == want.dtype
            if want.numel():
                assert float((got.float() - want.float()).abs().max()) <= tolerance
    assert packed.bias is not None if bias else packed.bias is None
    assert "in_features=96, out_features=300" in repr(packed)


@pytest.mark.model
def test_packing_a_real_model_keeps_its_logits_and_drops_the_weights(
    tiny_dirs: dict[str, Path],
) -> None:
    plain = load_adapter(tiny_dirs["qwen2-vl"], "cpu", torch.float32)
    packed = load_adapter(tiny_dirs["qwen2-vl"], "cpu", torch.float32)
    linears = [m for m in packed.language_model.layers.modules() if type(m) is torch.nn.Linear]
    vision_before = sum(type(m) is torch.nn.Linear for m in packed.model.model.visual.modules())
    report = pack_linears(packed.model, packed.language_model.layers, "onednn")
    assert report.error is None
    assert report.packed == len(linears) + 1 and report.kept == 0  # every one, and the LM head
    assert isinstance(packed.model.lm_head, PackedLinear)
    assert not any(type(m) is torch.nn.Linear for m in packed.language_model.layers.modules())
    vision_after = sum(type(m) is torch.nn.Linear for m in packed.model.model.visual.modules())
    assert vision_after == vision_before > 0  # the vision tower is not touched
    # no unpacked copy is left in the decoder layers (their norms keep plain parameters)
    left = sum(p.numel() for p in packed.language_model.layers.parameters())
    norms = sum(p.numel() for p in plain.language_model.layers.parameters() if p.dim() == 1)
    assert left <= norms
    ids = list(range(5, 45))
    with torch.inference_mode():  # the plain transformers forward (the self-check's reference)
        want, got = plain.reference_logits(ids), packed.reference_logits(ids)
    assert float((got - want).abs().max()) < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.model
def test_auto_packs_exactly_the_shapes_measured_faster(
    tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = load_adapter(tiny_dirs["llava"], "cpu", torch.float32)
    layers = adapter.language_model.layers
    mlp = layers[0].mlp
    faster = {(mlp.down_proj.in_features, mlp.down_proj.out_features)}  # down_proj's shape only
    measured: list[tuple[int, int]] = []

    def fake(linear: torch.nn.Linear, packed: PackedLinear) -> float:
        measured.append((linear.in_features, linear.out_features))
        return 2.0 if measured[-1] in faster else 0.5

    monkeypatch.setattr(cpu_linear, "onednn_faster", fake)
    report = pack_linears(adapter.model, layers, "auto")
    assert len(measured) == len(set(measured))  # once per shape, not per module
    for layer in layers:
        assert isinstance(layer.mlp.down_proj, PackedLinear)
        assert (
            type(layer.mlp.gate_proj) is torch.nn.Linear
        )  # a CPU load is unfused (model/fused.py)
    assert report.packed == len(layers)
    assert set(report.speedups.values()) == {2.0, 0.5}
    assert "oneDNN prepacked for" in report.describe() and "(auto)" in report.describe()


def test_the_measurement_stays_short_for_a_large_vocabulary() -> None:
    assert cpu_linear.measured_rows(torch.nn.Linear(896, 2432)) == (16, 246)
    assert cpu_linear.measured_rows(torch.nn.Linear(64, 64)) == (16, 256)
    head = torch.nn.Linear(1, 1)
    head.in_features, head.out_features = 4096, 152064  # no weight of that size is needed
    assert cpu_linear.measured_rows(head) == (16,)


class _FakeClock:
    """``time.perf_counter`` for :mod:`mmis.engine.execution.timing`: it stands still except
    while a watched module runs, which advances it by that module's cost for its rows; the
    first call of each (module, rows) — the warm-up — costs 100 times more, and the first
    timed call of the plain linear is "preempted" by a further second."""

    def __init__(self, costs: dict[torch.nn.Module, Callable[[int], float]]) -> None:
        self.now = 1000.0
        self.calls: list[tuple[str, int]] = []
        self.names = {module: name for name, module in zip(("plain", "packed"), costs, strict=True)}
        self.costs = costs
        for module in costs:
            module.register_forward_hook(self._ran)

    def perf_counter(self) -> float:
        return self.now

    def _ran(self, module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: object) -> None:
        name, rows = self.names[module], args[0].shape[0]
        seen = self.calls.count((name, rows))
        self.calls.append((name, rows))
        cost = self.costs[module](rows)
        self.now += cost * (100 if seen == 0 else 1) + (1.0 if name == "plain" and seen == 1 else 0)


@pytest.mark.parametrize("shape", [(64, 64), (896, 2432)])
def test_the_measurement_is_the_ratio_of_the_summed_best_times(
    shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a fake clock per callable the speed-up is exactly sum(plain) / sum(packed) over
    :func:`measured_rows`, each row count timed ``1 + REPEAT`` times per variant, the best
    (not the warm-up, not the preempted run) taken."""
    linear = _linear(*shape, torch.float32, bias=True)
    packed = PackedLinear(linear)

    def plain_cost(rows: int) -> float:
        return 1e-3 * rows

    def packed_cost(rows: int) -> float:
        return 0.5e-3 * rows + 0.01  # a fixed overhead: a loss at decode size, a win at prefill

    clock = _FakeClock({linear: plain_cost, packed: packed_cost})
    monkeypatch.setattr(timing, "time", clock)
    speedup = cpu_linear.onednn_faster(linear, packed)
    rows = cpu_linear.measured_rows(linear)
    assert len(rows) == 2  # a decode and a prefill size
    want = sum(map(plain_cost, rows)) / sum(map(packed_cost, rows))
    assert speedup == pytest.approx(want, rel=1e-9)
    # not the mean of per-row ratios, not one row's ratio: the sum is what was asked for
    per_row = [plain_cost(r) / packed_cost(r) for r in rows]
    assert all(abs(speedup - other) > 0.05 for other in [*per_row, sum(per_row) / len(per_row)])
    timed = sorted(set(clock.calls))
    assert timed == sorted((name, r) for name in ("plain", "packed") for r in rows)
    assert all(clock.calls.count(call) == 1 + cpu_linear.REPEAT for call in timed)


@pytest.mark.model
def test_the_measurement_is_real_and_torch_packs_nothing(tiny_dirs: dict[str, Path]) -> None:
    adapter = load_adapter(tiny_dirs["llava"], "cpu", torch.float32)
    linear = adapter.language_model.layers[0].mlp.up_proj
    speedup = cpu_linear.onednn_faster(linear, PackedLinear(linear))
    # a ratio of two real timings on a shared machine (a preempted one once made it 0.005):
    # only positive and finite here; the arithmetic is pinned by the fake-clock test above
    assert math.isfinite(speedup) and speedup > 0
    report = pack_linears(adapter.model, adapter.language_model.layers, "torch")
    assert report.packed == 0 and report.kept > 0
    assert type(adapter.model.lm_head) is torch.nn.Linear
    with pytest.raises(ValueError, match="--cpu-linear must be one of auto, onednn, torch"):
        pack_linears(adapter.model, adapter.language_model.layers, "mkl")


@pytest.mark.model
def test_a_onednn_that_cannot_run_leaves_every_module_as_it_was(
    tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    adapter = load_adapter(tiny_dirs["llava"], "cpu", torch.float32)
    calls = {"n": 0}
    real = cpu_linear._reorder

    def broken(weight: torch.Tensor, batch: list[int] | None) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] > 3:  # fails part-way: nothing may have been swapped already
            raise RuntimeError("no oneDNN kernel for this CPU")
        return real(weight, batch)

    monkeypatch.setattr(cpu_linear, "_reorder", broken)
    with caplog.at_level("INFO", logger="mmis.engine.execution.cpu_linear"):
        report = pack_adapter(adapter, "onednn")
    assert report.packed == 0 and report.error is not None
    assert not any(isinstance(m, PackedLinear) for m in adapter.model.modules())
    assert "oneDNN unusable: RuntimeError: no oneDNN kernel for this CPU" in caplog.text


@pytest.mark.model
def test_the_engine_says_what_it_packed(tiny_dirs: dict[str, Path]) -> None:
    with EngineHarness(tiny_dirs["llava"], "--cpu-linear", "auto") as engine:
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        [result] = engine.run(EngineCoreRequest("lin", list(range(3, 30)), [], params))
        log_text = engine.log_text()
    assert result.error is None and len(result.token_ids) == 3
    assert "cpu linear: oneDNN prepacked for" in log_text
    assert "measured oneDNN speed-up by shape:" in log_text
