"""A dead or hung engine surfaces fast: a real ``mmis serve``, its P1 killed and stopped.

One server start for the whole module: ``mmis serve`` on the tiny model (P0 in it with the
default settings, P1 its child, restarted when it dies) and a second front end, ``mmis
frontend --fail-fast --client-index 1``, on the same P1 (its addresses read from P1's command
line), so one kill exercises both policies.

- SIGKILL of P1 under 64 streaming chat clients (``max_tokens`` long, EOS ignored) and a few
  whole (non-streamed) requests on each front end:
  (a) every stream, bytes already sent, ends with the retryable ``engine_unavailable`` SSE
  error event within 2 s of the kill;
  (b) without fail-fast the whole requests in flight, and a new one sent during the restart,
  are healed on the restarted P1 (200, the drift-free output); with fail-fast the ones in
  flight get 503 (retryable ``engine_unavailable``, ``Retry-After``) within 2 s of the kill,
  and so does a new one during the restart; ``/ready`` of both is 503 within 2 s of the kill
  and stays so until a new P1 exists;
  (c) after the restart greedy outputs equal those before, on both front ends.
- (d) SIGSTOP of P1 under streams: each stream ends with the same SSE error once the heartbeat
  went missing (within ``liveness_timeout_s`` plus or minus one ``ping_interval_s``, and a
  second of slack), ``/ready`` is 503, the fail-fast front end answers 503; after SIGCONT the
  same P1 heals the whole request that waited for it.

Deadlines are measured from the signal by the client (its own lag included). Waits are bounded
polls of the processes' observable state, never sleeps standing in for it; teardown kills
serve and SIGCONTs and SIGKILLs every P1 it saw, so nothing leaks.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from procs import Proc, Serve, children, image_url, wait_for

from mmis.config import default_of, flag_of
from mmis.engine.config import EngineConfig
from mmis.frontend.config import FrontendConfig
from mmis.tiny_models.tiny_model import tiny_model_dir

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(600)]

STREAMS = 64  # the acceptance number
WHOLE = 3  # non-streamed requests in flight at the kill, per front end
LONG = 4000  # tokens, EOS ignored: the streams are still decoding at the signal
WHOLE_TOKENS = 1024  # the whole requests: surely still in P1 when the streams all are (128 raced)
DEADLINE_S = 2.0  # from the kill to each stream's error event / each fail-fast 503 / /ready
LIVENESS_S = default_of(FrontendConfig, "liveness_timeout_s")  # what the servers run with
PING_S = default_of(FrontendConfig, "ping_interval_s")
COLORS = [(200, 10, 10), (10, 200, 10), (10, 10, 200)]


def _flag(cmdline: list[str], name: str) -> str:
    return cmdline[cmdline.index(name) + 1]


@dataclass
class StreamResult:
    first_byte: threading.Event = field(default_factory=threading.Event)
    error: dict[str, Any] | None = None
    ended_at: float = 0.0  # monotonic, when the stream raised or ended
    finished: str | None = None  # a finish_reason (the stream was not cut)


class Front:
    """One front end's HTTP face."""

    def __init__(self, proc: Proc) -> None:
        self.proc = proc
        self.url = proc.root_url
        self.sdk = openai.OpenAI(
            base_url=self.url + "/v1", api_key="unused", timeout=300, max_retries=0
        )

    def ready(self) -> int:
        return httpx.get(self.url + "/ready", timeout=10).status_code

    def in_flight(self) -> float:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        for line in text.splitlines():
            if line.startswith("mmis_frontend_engine_requests_in_flight "):
                return float(line.split()[1])
        raise KeyError("mmis_frontend_engine_requests_in_flight")

    def whole(self, color: tuple[int, int, int], max_tokens: int = 8) -> httpx.Response:
        content = [
            {"type": "image_url", "image_url": {"url": image_url(color)}},
            {"type": "text", "text": "What is in the picture?"},
        ]
        body = {
            "model": "tiny",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": content}],
        }
        return httpx.post(self.url + "/v1/chat/completions", json=body, timeout=300)

    def text(self, color: tuple[int, int, int], max_tokens: int = 8) -> str:
        response = self.whole(color, max_tokens)
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["message"]["content"])

    def stream(self, index: int, result: StreamResult) -> None:
        try:
            chunks = self.sdk.chat.completions.create(
                model="tiny",
                max_tokens=LONG,
                temperature=0,
                stream=True,
                messages=[{"role": "user", "content": f"Count to {index + 3}"}],
                extra_body={"ignore_eos": True},
            )
            for chunk in chunks:
                result.first_byte.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    result.finished = chunk.choices[0].finish_reason
        except openai.APIError as exc:
            result.error = exc.body if isinstance(exc.body, dict) else {"message": str(exc)}
        finally:
            result.ended_at = time.monotonic()
            result.first_byte.set()

    def start_streams(self, count: int) -> tuple[list[StreamResult], list[threading.Thread]]:
        results = [StreamResult() for _ in range(count)]
        threads = [
            threading.Thread(target=self.stream, args=(i, r), daemon=True)
            for i, r in enumerate(results)
        ]
        for thread in threads:
            thread.start()
        for result in results:
            assert result.first_byte.wait(120), "a stream never got its first chunk"
        early = [(i, r.error, r.finished) for i, r in enumerate(results) if r.error or r.finished]
        assert not early, f"ended too soon (index, error, finish reason): {early[:4]}"
        return results, threads

    def start_whole(self, count: int) -> Callable[[], list[httpx.Response]]:
        """``count`` whole requests of COLORS[0] in flight; the returned call joins them."""
        responses: list[httpx.Response] = []

        def one() -> None:
            responses.append(self.whole(COLORS[0], WHOLE_TOKENS))

        threads = [threading.Thread(target=one, daemon=True) for _ in range(count)]
        for thread in threads:
            thread.start()

        def join() -> list[httpx.Response]:
            for thread in threads:
                thread.join(300)
            assert len(responses) == count, "a whole request never finished"
            return responses

        return join


class Pod:
    """``mmis serve`` (default settings) and a fail-fast ``mmis frontend`` on its P1."""

    def __init__(self, log_dir: Path) -> None:
        self.serve = Serve(log_dir, "--max-num-seqs", "96", env={})
        self.engines: set[int] = set()
        self.extra: Proc | None = None
        cmdline = Path(f"/proc/{self.engine_pid()}/cmdline").read_bytes().decode().split("\0")
        self.extra = Proc(
            "frontend-fail-fast",
            [
                "frontend",
                "--model",
                str(tiny_model_dir()),
                "--served-model-name",
                "tiny",
                "--port",
                "0",
                "--engine-input-address",
                _flag(cmdline, flag_of(EngineConfig, "input_address")),
                "--engine-output-address",
                _flag(cmdline, flag_of(EngineConfig, "output_address")),
                "--client-index",
                "1",
                "--fail-fast",
            ],
            log_dir,
            announces=True,
        )
        self.healing = Front(self.serve)
        self.fail_fast = Front(self.extra)
        self.serve.wait_http("/ready", 300)
        self.extra.wait_http("/ready", 300)

    def engine_pid(self, not_pid: int | None = None, timeout: float = 120.0) -> int:
        found: list[int] = []

        def one() -> bool:
            found[:] = [p for p in children(self.serve.popen.pid) if p != not_pid]
            return len(found) == 1

        wait_for("the engine child of serve", one, timeout)
        self.engines.add(found[0])
        return found[0]

    def close(self) -> None:
        if self.extra is not None:
            self.extra.stop(signal.SIGKILL)
        self.serve.stop(signal.SIGKILL)
        for pid in self.engines:
            for sig in (signal.SIGCONT, signal.SIGKILL):  # never leave an engine behind
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    started = Pod(tmp_path_factory.mktemp("engine-loss"))
    try:
        yield started
    finally:
        started.close()


class ReadyWatch:
    """Samples ``(sent at, /ready status, whether a P1 other than ``old`` existed before)``."""

    def __init__(self, pod: Pod, front: Front, old: int) -> None:
        self.samples: list[tuple[float, int, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(pod, front, old), daemon=True)
        self._thread.start()

    def _run(self, pod: Pod, front: Front, old: int) -> None:
        while not self._stop.is_set():
            new_p1 = any(p != old for p in children(pod.serve.popen.pid))
            self.samples.append((time.monotonic(), front.ready(), new_p1))
            time.sleep(0.05)  # sampling a probe; not a synchronisation

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def not_ready_after(self, since: float) -> float:
        """Seconds from ``since`` to the first 503; from then on, /ready stays 503 until a
        new P1 exists (asserted)."""
        first = next((t for t, status, _ in self.samples if t > since and status == 503), None)
        assert first is not None, "/ready never said not ready"
        early = [(t - since, s) for t, s, new_p1 in self.samples if t >= first and not new_p1]
        assert all(status == 503 for _, status in early), f"/ready before a new P1: {early}"
        return first - since


def _stream_errors(results: list[StreamResult], since: float, by: float) -> list[float]:
    """Every stream ended with the retryable engine_unavailable event; the delays."""
    delays = []
    for result in results:
        assert result.error is not None, f"a stream was not ended by an error: {result}"
        assert result.error.get("code") == "engine_unavailable", result.error
        assert result.error.get("retryable") is True, result.error
        delays.append(result.ended_at - since)
    assert max(delays) <= by, f"slowest stream error {max(delays):.2f}s after the signal"
    return delays


def _unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "engine_unavailable" and error["retryable"] is True, error
    assert error["type"] == "service_unavailable_error"
    assert int(response.headers["retry-after"]) >= 1


def test_sigkill_streams_end_at_once_whole_requests_heal_or_fail_fast(
    pod: Pod, record_property: Callable[[str, object], None]
) -> None:
    heal, fast = pod.healing, pod.fail_fast
    expected = {color: heal.text(color) for color in COLORS}
    long_expected = heal.text(COLORS[0], WHOLE_TOKENS)
    assert fast.text(COLORS[1]) == expected[COLORS[1]]
    engine = pod.engine_pid()

    streams, stream_threads = heal.start_streams(STREAMS)
    healed = heal.start_whole(WHOLE)
    failed = fast.start_whole(WHOLE)
    wait_for("every request in P1", lambda: heal.in_flight() == STREAMS + WHOLE)
    wait_for("every fail-fast request in P1", lambda: fast.in_flight() == WHOLE)
    watches = [ReadyWatch(pod, front, engine) for front in (heal, fast)]
    killed = time.monotonic()
    os.kill(engine, signal.SIGKILL)

    fast_answers = failed()
    fast_s = time.monotonic() - killed
    for thread in stream_threads:
        thread.join(60)
    delays = _stream_errors(streams, killed, DEADLINE_S)
    for response in fast_answers:
        _unavailable(response)
    assert fast_s <= DEADLINE_S, f"the fail-fast 503s took {fast_s:.2f}s"
    _unavailable(fast.whole(COLORS[1]))  # a new request during the restart: 503 at once
    # (b) without fail-fast: a new request during the restart waits, those in flight heal
    assert heal.text(COLORS[1]) == expected[COLORS[1]]
    for response in healed():
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == long_expected
    wait_for("the fail-fast /ready after the restart", lambda: fast.ready() == 200, 60)
    for watch in watches:
        watch.stop()
    not_ready = [watch.not_ready_after(killed) for watch in watches]
    assert max(not_ready) <= DEADLINE_S, f"/ready went 503 {not_ready}s after the kill"
    pod.engine_pid(not_pid=engine)
    # (c) greedy outputs after the restart equal those before, on both front ends
    for color in COLORS:
        assert heal.text(color) == expected[color]
    assert fast.text(COLORS[2]) == expected[COLORS[2]]
    print(
        f"\nSIGKILL: {STREAMS} stream errors {min(delays):.3f}-{max(delays):.3f}s after the kill;"
        f" {WHOLE} fail-fast 503s by {fast_s:.3f}s; /ready 503 after"
        f" {not_ready[0]:.3f}s / {not_ready[1]:.3f}s (healing / fail-fast)"
    )
    record_property("kill_to_stream_error_max_s", round(max(delays), 3))
    record_property("kill_to_fail_fast_503_s", round(fast_s, 3))
    record_property("kill_to_not_ready_s", round(max(not_ready), 3))


def test_sigstop_is_seen_after_the_liveness_timeout_and_sigcont_heals(
    pod: Pod, record_property: Callable[[str, object], None]
) -> None:
    heal, fast = pod.healing, pod.fail_fast
    long_expected = heal.text(COLORS[0], WHOLE_TOKENS)
    engine = pod.engine_pid()
    streams, stream_threads = heal.start_streams(8)
    waiting = heal.start_whole(1)
    wait_for("every request in P1", lambda: heal.in_flight() == 8 + 1)
    stopped = time.monotonic()
    os.kill(engine, signal.SIGSTOP)
    try:
        for thread in stream_threads:
            thread.join(60)
        delays = _stream_errors(streams, stopped, LIVENESS_S + PING_S + 1.0)
        assert min(delays) >= LIVENESS_S - PING_S, f"declared hung after {min(delays):.2f}s"
        assert heal.ready() == 503
        wait_for("the fail-fast front end to see it", lambda: fast.ready() == 503, 10)
        _unavailable(fast.whole(COLORS[1]))
    finally:
        os.kill(engine, signal.SIGCONT)
    (response,) = waiting()
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == long_expected
    wait_for("/ready after SIGCONT", lambda: heal.ready() == 200 == fast.ready(), 60)
    assert pod.engine_pid() == engine  # resumed, not replaced
    print(f"\nSIGSTOP: {len(delays)} stream errors {min(delays):.3f}-{max(delays):.3f}s after it")
    record_property("stop_to_stream_error_max_s", round(max(delays), 3))
