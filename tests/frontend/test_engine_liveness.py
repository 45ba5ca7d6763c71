"""P0's view of P1's liveness (``frontend/client/engine_liveness.py``) and the recovery rules for an
engine loss (``frontend/client/recovery.py``), against the scripted P1 (the real P1 shell, sockets,
codec and receiver cache in threads; only the model is scripted).

- A crash (P1's sockets closed) is seen by the socket monitor, not by a timeout: the client
  runs with a 30 s liveness timeout and still fails the request in flight at once; a restarted
  P1 brings the link up with its new epoch and receives the abort of the failed id.
- A hang (P1's input thread stalled, no outputs) is seen after ``liveness_timeout_s``; the
  same P1 answering again brings the link up with no epoch change and aborts the failed id.
- A P0 loop that is behind is not a silent P1: a blocked loop sent no ping, so there is no
  silence to count; and with a message from P1 waiting unread, P1 is not silent.
- Through the HTTP API: an engine loss does not spend the drift retry (a loss, then a miss on
  the restarted P1, is a 200 with the drift-free output); a stream that sent nothing is healed;
  ``fail_fast`` answers 503 + ``Retry-After`` at once; without it the wait ends after
  ``engine_wait_s`` with the same 503.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine, RunningFrontend, image_part
from scripted_stack import tiny_settings

from mmis.frontend.client.engine_client import EngineClient, EngineUnavailableError
from mmis.frontend.client.recovery import ENDPOINT_ROUTES
from mmis.protocol.messages import EngineCoreOutput, EngineCoreRequest, SamplingParams
from mmis.telemetry import catalog


async def _until(what: str, check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        await asyncio.sleep(0.01)  # polling another thread's state; not a synchronisation


def _request(rid: str, max_tokens: int = 5) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [5, 6, 7], sampling_params=SamplingParams(max_tokens=max_tokens))


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[list[FakeEngine]]:
    started: list[FakeEngine] = []
    yield started
    for engine in started:
        engine.core.gate.set()
        engine.stop()


async def test_a_crash_is_seen_at_once_and_a_restart_brings_the_link_up(
    tmp_path: Path, engines: list[FakeEngine]
) -> None:
    engine = FakeEngine(str(tmp_path)).start()
    engines.append(engine)
    # a 30 s liveness timeout: only the socket monitor can see the crash within the test
    client = EngineClient(
        engine.input_address, engine.output_address, ping_interval_s=0.2, liveness_timeout_s=30
    )
    await client.start(timeout=10)
    try:
        queue: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()
        engine.core.gate.clear()  # P1 holds the request: no output before the crash
        await client.add_requests([_request("r1")], queue)
        await _until("r1 in P1", lambda: "r1" in engine.core.added)
        engine.stop()  # P1's sockets close, as when its process dies
        out = await asyncio.wait_for(queue.get(), 5)
        assert out.request_id == "r1" and out.finish_reason == "error"
        assert out.error is not None and out.error.code == "engine_unavailable"
        assert out.error.retryable and "disconnected" in out.error.message
        assert not client.alive and client.losses == 1 and client.num_in_flight == 0
        with pytest.raises(EngineUnavailableError):  # nothing is sent while P1 is down
            await client.add_requests([_request("r2")], queue)
        with pytest.raises(EngineUnavailableError):  # no 30 s wait for a dead engine
            await asyncio.wait_for(client.call_utility("running"), 1)
        with pytest.raises(EngineUnavailableError):
            await client.wait_up(0.2)

        restarted = FakeEngine(str(tmp_path), epoch="epoch-2").start()
        engines.append(restarted)
        await client.wait_up(10)
        assert client.alive and client.cache_epoch == "epoch-2" and client.epoch_changes == 1
        # the failed id is aborted on the new P1 (it may have been queued in our socket)
        await _until("the abort of r1", lambda: "r1" in restarted.core.aborted)
        assert queue.empty()  # exactly one synthetic error for r1
        await client.add_requests([_request("r3", max_tokens=2)], queue)
        outs = [await asyncio.wait_for(queue.get(), 5) for _ in range(2)]
        assert [o.finish_reason for o in outs] == [None, "length"]
    finally:
        await client.close()


async def test_a_hang_is_seen_after_the_liveness_timeout_and_the_same_engine_resumes(
    tmp_path: Path, engines: list[FakeEngine]
) -> None:
    engine = FakeEngine(str(tmp_path)).start()
    engines.append(engine)
    client = EngineClient(
        engine.input_address, engine.output_address, ping_interval_s=0.1, liveness_timeout_s=0.6
    )
    await client.start(timeout=10)
    stall = threading.Event()
    answer = engine.proc._utility

    def stalled(call: Any) -> None:  # the input thread stops until ``stall`` is set
        stall.wait()
        answer(call)

    try:
        queue: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()
        engine.core.gate.clear()  # no outputs
        await client.add_requests([_request("r1")], queue)
        await _until("r1 in P1", lambda: "r1" in engine.core.added)
        engine.proc._utility = stalled
        stalled_at = time.monotonic()
        out = await asyncio.wait_for(queue.get(), 10)
        silent = time.monotonic() - stalled_at
        assert out.error is not None and out.error.code == "engine_unavailable"
        assert "hung" in out.error.message
        assert silent >= 0.6 - 0.2, f"declared hung after {silent:.2f}s of silence"
        assert not client.alive
        engine.proc._utility = answer
        stall.set()  # P1 answers the queued pings
        await client.wait_up(10)
        assert client.epoch_changes == 0 and client.losses == 1  # the same engine, resumed
        await _until("the abort of r1", lambda: "r1" in engine.core.aborted)
    finally:
        stall.set()
        await client.close()


async def test_a_p0_loop_behind_is_not_a_silent_engine(
    tmp_path: Path, engines: list[FakeEngine]
) -> None:
    engine = FakeEngine(str(tmp_path)).start()
    engines.append(engine)
    client = EngineClient(
        engine.input_address, engine.output_address, ping_interval_s=0.1, liveness_timeout_s=0.3
    )
    await client.start(timeout=10)
    try:
        await asyncio.sleep(0.5)  # pings answered: the link is up and quiet
        time.sleep(1.0)  # on purpose: P0's loop is blocked for longer than the timeout ...
        await asyncio.sleep(0.5)  # ... so it sent no ping meanwhile: no silence to count
        assert client.alive and client.losses == 0
        # a ping unanswered for 10 s, but P1's message waits unread: P1 is not silent
        client._asked_at = time.monotonic() - 10
        engine.proc._send(0, [EngineCoreOutput("nobody")])  # P1's thread; our loop is blocked
        deadline = time.monotonic() + 10
        while client._silent_for() != 0.0:
            assert time.monotonic() < deadline, "a waiting message did not count as P1 talking"
            time.sleep(0.01)  # polling without running our loop, on purpose
        await asyncio.sleep(0.5)  # the watchdog and the reader catch up
        assert client.alive and client.losses == 0
    finally:
        await client.close()


# ---------------------------------------------------------------------- through HTTP
class Stack:
    def __init__(self, directory: Path, **settings: Any) -> None:
        self.directory = directory
        self.engine = FakeEngine(str(directory)).start()
        self.frontend = RunningFrontend(
            tiny_settings(self.engine, ping_interval_s=0.2, **settings)
        ).start()
        self.http = httpx.Client(base_url=self.frontend.root_url, timeout=60)

    def restart_engine(self, epoch: str, misses: int = 0) -> None:
        """A new P1 on the same addresses (after the old one is stopped)."""
        engine = FakeEngine(str(self.directory), epoch=epoch)
        engine.force_misses(misses)
        self.engine = engine.start()

    def chat(self, color: tuple[int, int, int], **extra: Any) -> httpx.Response:
        body = {
            "model": "tiny",
            "max_tokens": 5,
            "temperature": 0,
            "messages": [{"role": "user", "content": [image_part(color)]}],
            **extra,
        }
        return self.http.post("/v1/chat/completions", json=body)

    def in_background(self, call: Callable[[], httpx.Response]) -> Callable[[], httpx.Response]:
        result: list[httpx.Response] = []
        thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
        thread.start()

        def join() -> httpx.Response:
            thread.join(60)
            assert result, "the request did not finish"
            return result[0]

        return join

    def wait_added(self, count: int) -> None:
        deadline = time.monotonic() + 30
        while len(self.engine.core.added) < count:
            assert time.monotonic() < deadline, "the request never reached P1"
            time.sleep(0.01)  # polling P1's thread; not a synchronisation

    def retries(self, **outcome: str) -> float:
        state = self.frontend.state
        assert state is not None
        route = ENDPOINT_ROUTES["chat"]
        return state.metrics.total(catalog.RETRIES, endpoint=route, **outcome)

    def close(self) -> None:
        self.http.close()
        self.frontend.stop()
        self.engine.core.gate.set()
        self.engine.stop()


@pytest.fixture
def stacks(tmp_path: Path) -> Iterator[list[Stack]]:
    made: list[Stack] = []
    yield made
    for stack in made:
        stack.close()


def _content(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def _streamed(sse: str) -> str:
    """The text of a chat stream (its ``[DONE]`` required: the stream was not cut)."""
    events = [line.removeprefix("data: ") for line in sse.splitlines() if line]
    assert events[-1] == "[DONE]", sse
    chunks = [json.loads(event) for event in events[:-1]]
    assert all("error" not in chunk for chunk in chunks), sse
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def _unavailable(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 503, response.text
    assert int(response.headers["retry-after"]) >= 1
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == "engine_unavailable" and error["retryable"] is True
    return error


def test_an_engine_loss_does_not_spend_the_drift_retry(tmp_path: Path, stacks: list[Stack]) -> None:
    stack = Stack(tmp_path)
    stacks.append(stack)
    color = (40, 90, 200)
    baseline = _content(stack.chat(color))
    streamed_before = stack.chat((1, 2, 3), stream=True).text
    stack.engine.core.gate.clear()  # both requests wait in P1, no byte sent yet
    added = len(stack.engine.core.added)
    whole = stack.in_background(lambda: stack.chat(color))
    stream = stack.in_background(lambda: stack.chat((1, 2, 3), stream=True))
    stack.wait_added(added + 2)
    stack.engine.stop()
    # the restarted P1 misses once more (forced): the healed attempt still has its drift retry
    stack.restart_engine("epoch-2", misses=1)
    assert _content(whole()) == baseline
    healed = stream()
    assert healed.status_code == 200, healed.text
    assert _streamed(healed.text) == _streamed(streamed_before)
    assert len(stack.engine.proc.misses_sent) == 1  # the forced miss happened, was retried
    assert stack.retries(outcome="success") == 1


def test_fail_fast_answers_503_with_retry_after_at_once(
    tmp_path: Path, stacks: list[Stack]
) -> None:
    stack = Stack(tmp_path, fail_fast=True)
    stacks.append(stack)
    stack.engine.core.gate.clear()
    added = len(stack.engine.core.added)
    in_flight = stack.in_background(lambda: stack.chat((5, 5, 5)))
    stack.wait_added(added + 1)
    stack.engine.stop()
    _unavailable(in_flight())
    _unavailable(stack.chat((6, 6, 6)))  # a new request while P1 is down
    assert stack.http.get("/ready").status_code == 503
    stack.restart_engine("epoch-2")
    deadline = time.monotonic() + 30
    while stack.http.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, "/ready never came back"
    assert _content(stack.chat((6, 6, 6)))


def test_waiting_for_the_engine_is_bounded_by_engine_wait_s(
    tmp_path: Path, stacks: list[Stack]
) -> None:
    stack = Stack(tmp_path, engine_wait_s=1.0)
    stacks.append(stack)
    stack.engine.stop()
    asked = time.monotonic()
    error = _unavailable(stack.chat((7, 7, 7)))
    assert time.monotonic() - asked >= 1.0  # it waited for the engine, then gave up
    assert "did not come back within 1s" in error["message"]
