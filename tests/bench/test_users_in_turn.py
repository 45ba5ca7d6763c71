"""``mmis bench serve --questions-per-image N`` (users each asking N questions about their own
images, in order): the workload (a user's requests share its images, the images first), the
load loop (a user's requests one after the other, the concurrency counting users; ``send``
replaced by a recorder: the loop is the piece under test) and the real command against the
tiny ``mmis serve`` (the questions of a user hit its image's prefix-cache blocks)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from procs import MMIS, Proc, series

from mmis.bench import serve
from mmis.bench.client import RequestOutput
from mmis.bench.datasets import DatasetError, image_folder, random_mm


def test_users_share_their_images_and_put_them_first(tmp_path: Path) -> None:
    requests = random_mm(7, width=8, height=8, input_len=3, questions=3, seed=1)
    assert [r.session for r in requests] == [0, 0, 0, 1, 1, 1, 2]  # the last user asks once
    assert len({r.images for r in requests[:3]}) == len({r.images for r in requests[3:6]}) == 1
    assert len({r.images for r in requests}) == 3 and all(r.images_first for r in requests)
    assert len({r.prompt for r in requests}) == 7
    body = serve.build_body(requests[0], "m", "/v1/chat/completions")
    assert [p["type"] for p in body["messages"][0]["content"]] == ["image_url", "text"]
    # one question each: vLLM's random-mm, unchanged
    alone = random_mm(3, width=8, height=8, seed=1)
    assert [(r.session, r.images_first) for r in alone] == [(None, False)] * 3
    for n in range(2):
        Image.new("RGB", (4, 4), (n, 0, 0)).save(tmp_path / f"{n}.png")
    (tmp_path / "prompts.txt").write_text("a\nb\nc\n")
    folder = image_folder(tmp_path, 5, questions=2)
    assert [(r.session, r.prompt) for r in folder] == [
        (0, "a"),
        (0, "b"),
        (1, "c"),
        (1, "a"),
        (2, "b"),
    ]
    assert folder[0].images == folder[1].images == folder[4].images != folder[2].images
    with pytest.raises(DatasetError, match="--questions-per-image"):
        random_mm(3, questions=0)


def test_a_users_requests_go_in_turn_and_concurrency_counts_users(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[tuple[str, int]] = []

    async def fake_send(http: Any, url: str, body: dict[str, Any], **_: Any) -> RequestOutput:
        events.append(("start", body["n"]))
        await asyncio.sleep(0.002 * (3 - body["n"] % 3))  # later questions answer sooner
        events.append(("end", body["n"]))
        return RequestOutput(success=True, generated_text=str(body["n"]))

    monkeypatch.setattr(serve, "send", fake_send)
    bodies = [{"n": n} for n in range(9)]
    outputs, _ = asyncio.run(
        serve.run_requests(
            "http://x", bodies, max_concurrency=2, sessions=[n // 3 for n in range(9)]
        )
    )
    assert [o.generated_text for o in outputs] == [str(n) for n in range(9)]
    for n in range(9):
        if n % 3:  # a question starts once the user's previous one answered
            assert events.index(("start", n)) > events.index(("end", n - 1))
    in_flight = peak = 0
    for kind, _n in events:
        in_flight += 1 if kind == "start" else -1
        peak = max(peak, in_flight)
    assert peak == 2
    # the third user starts once one of the first two asked all its questions
    assert events.index(("start", 6)) > min(events.index(("end", 2)), events.index(("end", 5)))


def test_questions_of_a_user_hit_its_image_prefix(tiny_server: Proc, tmp_path: Path) -> None:
    hits = "mmis_prefix_cache_hits_total"
    before = series(tiny_server, hits)
    cmd = [
        *MMIS, "bench", "serve", "--base-url", tiny_server.root_url, "--model", "tiny",
        "--num-prompts", "4", "--questions-per-image", "2", "--random-mm-width", "64",
        "--random-mm-height", "64", "--random-input-len", "4", "--random-output-len", "2",
        "--max-concurrency", "2", "--seed", "11", "--save-result", "--result-dir", str(tmp_path),
        "--result-filename", "r.json",
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "r.json").read_text())["completed"] == 4
    deadline = time.monotonic() + 15  # P1's counters reach /metrics by a periodic stats poll
    while series(tiny_server, hits) <= before and time.monotonic() < deadline:
        time.sleep(0.25)
    assert series(tiny_server, hits) > before
