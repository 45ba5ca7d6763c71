"""``--tensor-parallel-size 2`` on CPU: two real processes (gloo), greedy parity with transformers.

Rank 0 is the ``mmis engine`` process; it starts rank 1, which loads the same checkpoint and
keeps half of every layer's heads and MLP (``engine/execution/tensor_parallel.py``). Every answer
must be the token ids of plain ``generate(do_sample=False)``: Qwen2-VL (M-RoPE positions travel with
the step) with images, chunked prefill and a prefix hit; Gemma 3 (sliding windows and an
image's bidirectional span travel with the step's metadata). The start-up self-check runs on
both ranks. A split that does not divide is refused at start-up, naming the numbers.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_harness import EngineHarness
from engine_inputs import ModelKit, image, kit_for, renamed
from engine_references import References, Spec

pytestmark = [pytest.mark.model, pytest.mark.slow]

TEXT = "What is in the picture? A red square, a blue circle and a green line."


def specs() -> list[Spec]:
    return [
        ("Hello, how are you today?", [], 10),
        ("Describe this image in one short sentence, please.", [image(1)], 10),
        (TEXT, [image(2), image(3)], 12),
    ]


@pytest.fixture(scope="module", params=["qwen2-vl", "gemma3"])
def kit(request: pytest.FixtureRequest, tiny_dirs: dict[str, Path]) -> ModelKit:
    return kit_for(request.param, tiny_dirs[request.param])


@pytest.fixture(scope="module")
def refs(kit: ModelKit) -> Iterator[References]:
    with References(kit, specs()) as references:
        yield references


@pytest.fixture(scope="module")
def engine(kit: ModelKit, refs: References) -> Iterator[EngineHarness]:
    args = ["--tensor-parallel-size", "2", "--max-num-batched-tokens", "20"]
    with EngineHarness(kit.path, *args, "--num-kv-blocks", "64") as eng:
        yield eng


def test_two_ranks_answer_as_transformers(
    kit: ModelKit, engine: EngineHarness, refs: References
) -> None:
    assert "tensor parallel: 2 ranks (cpu)" in engine.log_text()
    assert "batch limits: at most 64 sequences (default) and 20 tokens a step (set)" in (
        engine.log_text()
    )
    assert "self-check passed" in engine.log_text()  # its reference forward ran on both ranks
    requests = [kit.request(t, imgs, max_tokens=m) for t, imgs, m in specs()]
    results = engine.run(*requests)  # together: one step holds several sequences
    for res, (text, images, max_tokens) in zip(results, specs(), strict=True):
        assert res.error is None, res.error
        assert res.token_ids == refs(text, images, max_tokens), (kit.family, text)
    [again] = engine.run(renamed(requests[2]))
    assert again.num_cached_tokens > 0 and again.token_ids == results[2].token_ids


def test_a_split_that_does_not_divide_is_refused(tiny_dirs: dict[str, Path]) -> None:
    # 2 KV heads cannot be split over 4 ranks
    cmd = [sys.executable, "-m", "mmis", "engine", "--model", str(tiny_dirs["llava"])]
    done = subprocess.run(
        [*cmd, "--tensor-parallel-size", "4"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0
    assert "KV heads (2) does not divide by --tensor-parallel-size 4" in done.stderr
