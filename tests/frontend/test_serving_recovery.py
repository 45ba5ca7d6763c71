"""The recovery chain through the HTTP API (S1b, S3, S4, S5) against the scripted P1.

Real P0 (uvicorn, FastAPI, renderer, shadow, engine client), real ZMQ and the real P1 shell
and receiver cache; only the model is scripted. Drift is created with the fake's knobs:
``evict_all_before_next`` (P1 silently lost everything) and ``force_misses`` (P1 reports a
miss even for items that carried data: the only way to make the retry miss too).
"""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine, RunningFrontend, image_part
from scripted_stack import tiny_settings

from mmis.frontend.client.recovery import ENDPOINT_ROUTES
from mmis.frontend.state import FrontendState
from mmis.telemetry import catalog


class Stack:
    def __init__(self, directory: Path, liveness_timeout_s: float = 10.0) -> None:
        self.directory = directory
        self.engine = FakeEngine(str(directory)).start()
        settings = tiny_settings(
            self.engine, ping_interval_s=0.2, liveness_timeout_s=liveness_timeout_s
        )
        self.frontend = RunningFrontend(settings).start()
        self.client = openai.OpenAI(
            base_url=self.frontend.base_url, api_key="x", timeout=30, max_retries=0
        )

    @property
    def state(self) -> FrontendState:
        assert self.frontend.state is not None
        return self.frontend.state

    def retries(self, endpoint: str, **outcome: str) -> float:
        return self.state.metrics.total(
            catalog.RETRIES, endpoint=ENDPOINT_ROUTES[endpoint], **outcome
        )

    def restart_engine(self, epoch: str) -> None:
        self.engine.stop()
        self.engine = FakeEngine(str(self.directory), epoch=epoch).start()

    def close(self) -> None:
        self.frontend.stop()
        self.engine.stop()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path)
    try:
        yield s
    finally:
        s.close()


def _chat(stack: Stack, part: dict, **kw):  # type: ignore[no-untyped-def]
    return stack.client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": [part, {"type": "text", "text": "Describe"}]}],
        max_tokens=kw.pop("max_tokens", 5),
        temperature=0,
        **kw,
    )


def test_s3_hash_only_client_after_eviction(stack: Stack) -> None:
    with_data = image_part((30, 160, 90), uuid="photo-1")
    first = _chat(stack, with_data)
    by_uuid = {"type": "image_url", "image_url": {"uuid": "photo-1"}}
    assert _chat(stack, by_uuid).choices[0].message.content == first.choices[0].message.content
    stack.engine.evict_all_before_next()
    with pytest.raises(openai.UnprocessableEntityError) as err:
        _chat(stack, by_uuid)
    body = err.value.body
    assert isinstance(body, dict)  # the SDK unwraps {"error": {...}}
    assert body["code"] == "multimodal_cache_miss"
    assert body["retryable"] is True
    assert body["missing_uuids"] == ["photo-1"]
    assert "photo-1" in body["message"]
    # the shadow forgot it, so the next hash-only request is refused before reaching P1
    with pytest.raises(openai.UnprocessableEntityError):
        _chat(stack, by_uuid)
    healed = _chat(stack, with_data)
    assert healed.choices[0].message.content == first.choices[0].message.content
    assert stack.retries("chat", outcome="hash_only") == 1


def test_s1_drift_is_healed_by_one_retry_with_identical_output(stack: Stack) -> None:
    part = image_part((120, 20, 220))
    baseline = _chat(stack, part).choices[0].message.content
    hits = stack.state.metrics.total(catalog.SHADOW_HITS)
    stack.engine.evict_all_before_next()
    healed = _chat(stack, part)
    assert healed.choices[0].message.content == baseline
    assert stack.state.metrics.total(catalog.SHADOW_HITS) == hits + 1  # it was sent as a hit ...
    assert stack.state.metrics.total(catalog.DRIFT_MISSES) == 1  # ... P1 missed it ...
    assert stack.retries("chat", outcome="success") == 1  # healed


@pytest.mark.parametrize("endpoint", ["chat", "completions", "embeddings"])
def test_s4_second_miss_is_a_503(stack: Stack, endpoint: str) -> None:
    stack.engine.force_misses(2)
    with pytest.raises(openai.InternalServerError) as err:
        if endpoint == "chat":
            _chat(stack, image_part((9, 9, 9)))
        elif endpoint == "completions":
            stack.client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
        else:
            stack.client.embeddings.create(
                model="tiny",
                input=[image_part((9, 9, 9)), {"type": "text", "text": "x"}],  # type: ignore[list-item]
            )
    assert err.value.status_code == 503
    body = err.value.body
    assert isinstance(body, dict)
    assert body["code"] == "multimodal_cache_miss" and body["retryable"] is True
    assert len(stack.engine.proc.misses_sent) == 2  # the first try and exactly one retry
    assert stack.retries(endpoint, outcome="failed") == 1


def test_s4_stream_miss_before_first_byte_is_a_503_status(stack: Stack) -> None:
    stack.engine.force_misses(2)
    with pytest.raises(openai.InternalServerError) as err:
        list(_chat(stack, image_part((8, 8, 8)), stream=True))
    assert err.value.status_code == 503


def test_s4_stream_that_sent_bytes_ends_with_an_sse_error_event(stack: Stack) -> None:
    stack.engine.core.pause_after_first_token = True
    body = {
        "model": "tiny",
        "stream": True,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": [image_part((70, 7, 7)), "x"][:1]}],
    }
    url = stack.frontend.base_url + "/chat/completions"
    lines: list[str] = []
    with httpx.Client(timeout=30) as http, http.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line:
                continue
            lines.append(line)
            if len(lines) == 1:  # the first token is out: P1 "crashes" and comes back
                stack.engine.core.pause_after_first_token = False
                stack.restart_engine("epoch-2")
    assert json.loads(lines[0][len("data: ") :])["choices"][0]["delta"]["role"] == "assistant"
    error = json.loads(lines[-2][len("data: ") :])["error"]
    # P1's end closed: the engine client saw it gone (before any restart) and said so
    assert error["code"] == "engine_unavailable" and error["retryable"] is True
    assert lines[-1] == "data: [DONE]"
    # the restarted engine serves the next request, with the shadow cleared by the epoch change
    assert _chat(stack, image_part((70, 7, 7))).choices[0].finish_reason == "length"
    assert stack.state.epoch_changes == 1


def test_s5_n3_drifted_request_errors_once_and_returns_three_choices(stack: Stack) -> None:
    part = image_part((3, 100, 200))
    baseline = _chat(stack, part, n=3, seed=11)
    stack.engine.evict_all_before_next()
    healed = _chat(stack, part, n=3, seed=11)
    assert [c.message.content for c in healed.choices] == [
        c.message.content for c in baseline.choices
    ]
    assert stack.retries("chat") == 1  # one error handled, not three
    # the first sibling's miss aborted the two others (its own miss was terminal already)
    attempt0 = sorted({rid for rid in stack.engine.proc.missed if "-a0-" in rid})
    assert len(attempt0) >= 1
    aborted = set(stack.engine.core.aborted)
    assert {r for r in aborted if "-a0-" in r} == {
        r.replace("-a0-0", f"-a0-{i}") for r in attempt0[:1] for i in (1, 2)
    }
    assert stack.frontend.state is not None
    assert stack.frontend.state.client.num_in_flight == 0


def test_client_disconnect_aborts_the_request_in_p1(stack: Stack) -> None:
    body = json.dumps(
        {"model": "tiny", "max_tokens": 50, "messages": [{"role": "user", "content": "Hello"}]}
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with stack.engine.held():
        stack.engine.core.request_added.clear()
        stack.engine.core.request_aborted.clear()
        with socket.create_connection(("127.0.0.1", stack.frontend.port), timeout=10) as sock:
            sock.sendall(head + body)
            assert stack.engine.core.request_added.wait(10)  # P1 runs it (and is held)
            rid = stack.engine.core.added[-1]
        # the client is gone before any response byte: P0 must abort the request in P1
        assert stack.engine.core.request_aborted.wait(10)
        assert rid in stack.engine.core.aborted
    assert stack.frontend.state is not None
    assert stack.frontend.state.client.num_in_flight == 0


def test_ready_follows_the_engine_health_is_the_front_end(tmp_path: Path) -> None:
    """/ready (readiness) goes false while the engine is gone and back after it; /health
    (the front-end container's liveness) stays 200: kubelet must not restart P0 for P1."""
    stack = Stack(tmp_path, liveness_timeout_s=1.0)
    try:
        health = stack.frontend.root_url + "/health"
        ready = stack.frontend.root_url + "/ready"
        with httpx.Client(timeout=10) as http:
            assert http.get(ready).status_code == http.get(health).status_code == 200
            stack.engine.stop()
            deadline = time.monotonic() + 30
            while http.get(ready).status_code == 200:  # pings go unanswered from now on
                assert time.monotonic() < deadline, "/ready never noticed the dead engine"
            assert http.get(health).status_code == 200
            stack.engine = FakeEngine(str(tmp_path), epoch="epoch-2").start()
            while http.get(ready).status_code != 200:
                assert time.monotonic() < deadline + 30, "/ready never saw the engine again"
            assert http.get(health).status_code == 200
    finally:
        stack.close()
