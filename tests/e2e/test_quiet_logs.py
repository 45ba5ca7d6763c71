"""What a newcomer sees of a real ``mmis serve`` (issue 48 item 6), on conftest's shared
``tiny_serve`` (tiny LLaVA, its stdout and stderr in ``tiny_serve.log_path``):

- its log holds no access line for a successful probe, scrape, stats read or version call
  (a pod's log was mostly ``/health`` and ``/ready``), while API calls and failed answers
  still get theirs (``mmis/frontend/access_log.py``);
- its log holds no progress bar (transformers' "Loading weights" ``\\r`` frames): stderr is
  a file here, as in a container;
- the tiny model's answers, greedy and sampled, hold no control character (its vocabulary
  has none: ``mmis/tiny_models/tiny_tokenizer.py``).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import httpx
import pytest

from mmis.tiny_models.tiny_tokenizer import CONTROL_CHARS

sys.path.insert(0, str(Path(__file__).parent))
from procs import Proc, chat_body

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(300)]

QUIET = ("/health", "/ready", "/metrics", "/stats/cache", "/version")


def _log(proc: Proc) -> str:
    return proc.log_path.read_bytes().decode(errors="replace")


def test_probe_and_scrape_access_lines_are_not_logged(tiny_serve: Proc) -> None:
    with httpx.Client(base_url=tiny_serve.root_url, timeout=30) as http:
        for _ in range(5):
            for path in QUIET:
                assert http.get(path).status_code == 200, path
        assert http.get("/no-such-path").status_code == 404
        assert http.get("/v1/models").status_code == 200  # logged last: the flush marker
    deadline = time.monotonic() + 10
    while '"GET /v1/models' not in _log(tiny_serve) and time.monotonic() < deadline:
        time.sleep(0.1)
    log = _log(tiny_serve)
    assert re.search(r'"GET /v1/models HTTP/[\d.]+" 200', log), log[-2000:]
    assert re.search(r'"GET /no-such-path HTTP/[\d.]+" 404', log), log[-2000:]
    quiet = "|".join(re.escape(p) for p in QUIET)
    logged = re.findall(rf'"GET (?:{quiet})\S* HTTP/[\d.]+" 2\d\d.*', log)
    assert not logged, logged[:5]


def test_no_progress_bar_in_the_log(tiny_serve: Proc) -> None:
    log = tiny_serve.log_path.read_bytes()
    assert b"engine ready" in log  # the model was loaded into this log
    assert b"\r" not in log and b"Loading weights" not in log, log[:3000]


def test_answers_hold_no_control_characters(tiny_serve: Proc) -> None:
    """Greedy and sampled tokens, past end-of-sequence: 4 x 64 + 64 tokens."""
    url = tiny_serve.root_url + "/v1/chat/completions"
    greedy = chat_body((30, 160, 90), max_tokens=64) | {"ignore_eos": True}
    sampled = greedy | {"temperature": 1.5, "n": 4, "seed": 7}
    texts = []
    for body in (greedy, sampled):
        answer = httpx.post(url, json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        for choice in answer.json()["choices"]:
            texts.append(choice["message"]["content"])
    assert len(texts) == 5 and all(texts)
    bad = [t for t in texts if set(t) & set(CONTROL_CHARS)]
    assert not bad, [ascii(t) for t in bad]
