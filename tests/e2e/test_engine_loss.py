"""A dead or hung engine surfaces fast: real ``mmis serve`` processes, P1 killed or stopped.

Two server starts (the tiny model, P1 the child of the serve process):

- **Healing** (default settings): 64 streaming chat clients (``max_tokens`` long, EOS
  ignored) and a few whole (non-streamed) requests are in P1 when it is SIGKILLed.
  (a) every stream, bytes already sent, ends with the retryable ``engine_unavailable`` SSE
  error event within 2 s of the kill; (b) ``/ready`` is 503 within 2 s of the kill and
  stays so until a new P1 exists; the whole requests in flight, and a new one sent during
  the restart, are healed on the restarted P1 (200); (c) greedy outputs equal those before.
  (d) SIGSTOP of the restarted P1 under streams: each stream ends with the same SSE error
  once the heartbeat went missing (after ``liveness_timeout_s``, within that plus one
  ``ping_interval_s`` and a second of slack), ``/ready`` is 503; after SIGCONT the whole
  request in flight is healed with the same output.
- **Fail-fast** (``--fail-fast``): the whole requests in flight get 503 with the retryable
  ``engine_unavailable`` code and ``Retry-After`` within 2 s of the kill; so does a new
  request during the restart; ``/ready`` is 503.

Deadlines are measured from the signal, by the client (its own lag included). Waits are
bounded polls of the processes' observable state, never sleeps standing in for it.
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
from procs import Serve, image_url

from mmis.config import default_of
from mmis.frontend.config import FrontendConfig

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(600)]

STREAMS = 64  # the acceptance number
WHOLE = 4  # non-streamed requests in flight at the kill
LONG = 4000  # tokens, EOS ignored: the streams are still decoding at the signal
WHOLE_TOKENS = 128  # the whole requests: still in P1 at the signal, quick to redo
DEADLINE_S = 2.0  # from the kill to each stream's error event / each fail-fast 503
LIVENESS_S = default_of(FrontendConfig, "liveness_timeout_s")  # what the server runs with
PING_S = default_of(FrontendConfig, "ping_interval_s")
COLORS = [(200, 10, 10), (10, 200, 10), (10, 10, 200)]


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def _wait_for(what: str, check: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f}s")
        time.sleep(0.02)  # polling another process's state; not a synchronisation


@dataclass
class StreamResult:
    first_byte: threading.Event = field(default_factory=threading.Event)
    error: dict[str, Any] | None = None
    ended_at: float = 0.0  # monotonic, when the stream raised or ended
    finished: str | None = None  # a finish_reason (the stream was not cut)


class Server:
    """``mmis serve`` on the tiny model, P1 allowed more sequences than the test runs."""

    def __init__(self, log_dir: Path, *extra: str) -> None:
        self.proc = Serve(log_dir, "--max-num-seqs", "96", *extra, env={})
        self.sdk = openai.OpenAI(
            base_url=self.proc.root_url + "/v1", api_key="unused", timeout=300, max_retries=0
        )
        self.engines: set[int] = set()
        self.proc.wait_http("/ready", 300)

    def engine_pid(self, not_pid: int | None = None, timeout: float = 120.0) -> int:
        found: list[int] = []

        def one() -> bool:
            found[:] = [p for p in _children(self.proc.popen.pid) if p != not_pid]
            return len(found) == 1

        _wait_for("the engine child of serve", one, timeout)
        self.engines.add(found[0])
        return found[0]

    def ready(self) -> int:
        return httpx.get(self.proc.root_url + "/ready", timeout=10).status_code

    def in_flight(self) -> float:
        text = httpx.get(self.proc.root_url + "/metrics", timeout=30).text
        for line in text.splitlines():
            if line.startswith("mmis_frontend_engine_requests_in_flight "):
                return float(line.split()[1])
        raise KeyError("mmis_frontend_engine_requests_in_flight")

    def whole_body(self, color: tuple[int, int, int], max_tokens: int) -> dict[str, Any]:
        content = [
            {"type": "image_url", "image_url": {"url": image_url(color)}},
            {"type": "text", "text": "What is in the picture?"},
        ]
        return {
            "model": "tiny",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": content}],
        }

    def whole(self, color: tuple[int, int, int], max_tokens: int = 8) -> httpx.Response:
        url = self.proc.root_url + "/v1/chat/completions"
        return httpx.post(url, json=self.whole_body(color, max_tokens), timeout=300)

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

    def close(self) -> None:
        self.proc.stop(signal.SIGKILL)
        for pid in self.engines:
            for sig in (signal.SIGCONT, signal.SIGKILL):  # never leave an engine behind
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for server in started:
        server.close()


def _start_streams(server: Server, count: int) -> tuple[list[StreamResult], list[threading.Thread]]:
    results = [StreamResult() for _ in range(count)]
    threads = [
        threading.Thread(target=server.stream, args=(i, r), daemon=True)
        for i, r in enumerate(results)
    ]
    for thread in threads:
        thread.start()
    for result in results:
        assert result.first_byte.wait(120), "a stream never got its first chunk"
    assert all(r.error is None and r.finished is None for r in results), "ended too soon"
    return results, threads


def _start_whole(
    server: Server, color: tuple[int, int, int], count: int
) -> tuple[list[httpx.Response], list[threading.Thread]]:
    responses: list[httpx.Response] = []
    threads = [
        threading.Thread(
            target=lambda: responses.append(server.whole(color, WHOLE_TOKENS)), daemon=True
        )
        for _ in range(count)
    ]
    for thread in threads:
        thread.start()
    return responses, threads


def _check_stream_errors(results: list[StreamResult], since: float, by: float) -> list[float]:
    """Every stream ended with the retryable engine_unavailable event; its delays."""
    delays = []
    for result in results:
        assert result.error is not None, f"a stream was not ended by an error: {result}"
        assert result.error.get("code") == "engine_unavailable", result.error
        assert result.error.get("retryable") is True, result.error
        delays.append(result.ended_at - since)
    assert max(delays) <= by, f"slowest stream error {max(delays):.2f}s after the signal"
    return delays


class ReadyWatch:
    """Samples ``(sent at, /ready status, whether a P1 other than ``old`` existed before)``."""

    def __init__(self, server: Server, old: int) -> None:
        self.samples: list[tuple[float, int, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(server, old), daemon=True)
        self._thread.start()

    def _run(self, server: Server, old: int) -> None:
        while not self._stop.is_set():
            new_p1 = any(p != old for p in _children(server.proc.popen.pid))
            self.samples.append((time.monotonic(), server.ready(), new_p1))
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


def test_engine_loss_is_seen_at_once_and_healed(
    tmp_path: Path, servers: list[Server], record_property: Callable[[str, object], None]
) -> None:
    server = Server(tmp_path)
    servers.append(server)
    expected = {color: server.whole(color).json()["choices"][0]["message"] for color in COLORS}
    long_expected = server.whole(COLORS[0], WHOLE_TOKENS).json()["choices"][0]["message"]
    engine = server.engine_pid()

    # (a) + (b): SIGKILL under 64 streams and WHOLE whole requests
    streams, stream_threads = _start_streams(server, STREAMS)
    whole, whole_threads = _start_whole(server, COLORS[0], WHOLE)
    _wait_for("every request in P1", lambda: server.in_flight() == STREAMS + WHOLE)
    ready = ReadyWatch(server, engine)
    killed = time.monotonic()
    os.kill(engine, signal.SIGKILL)
    for thread in stream_threads:
        thread.join(60)
    delays = _check_stream_errors(streams, killed, DEADLINE_S)
    during = server.whole(COLORS[1])  # a new request while P1 restarts waits for it
    for thread in whole_threads:
        thread.join(300)
    ready.stop()
    assert during.status_code == 200, during.text
    assert during.json()["choices"][0]["message"] == expected[COLORS[1]]
    assert [r.status_code for r in whole] == [200] * WHOLE, [r.text for r in whole]
    assert all(r.json()["choices"][0]["message"] == long_expected for r in whole)
    not_ready = ready.not_ready_after(killed)
    assert not_ready <= DEADLINE_S, f"/ready went 503 {not_ready:.2f}s after the kill"
    restarted = server.engine_pid(not_pid=engine)
    # (c) greedy outputs after the restart equal those before
    for color in COLORS:
        assert server.whole(color).json()["choices"][0]["message"] == expected[color]
    print(
        f"\nSIGKILL: {STREAMS} stream errors {min(delays):.3f}-{max(delays):.3f}s after the kill;"
        f" /ready 503 after {not_ready:.3f}s"
    )
    record_property("kill_to_stream_error_max_s", round(max(delays), 3))
    record_property("kill_to_not_ready_s", round(not_ready, 3))

    # (d) SIGSTOP: the heartbeat goes missing; after SIGCONT the whole request is healed
    streams, stream_threads = _start_streams(server, 8)
    whole, whole_threads = _start_whole(server, COLORS[0], 1)
    _wait_for("every request in P1", lambda: server.in_flight() == 8 + 1)
    stopped = time.monotonic()
    os.kill(restarted, signal.SIGSTOP)
    try:
        for thread in stream_threads:
            thread.join(60)
        bound = LIVENESS_S + PING_S + 1.0
        delays = _check_stream_errors(streams, stopped, bound)
        assert min(delays) >= LIVENESS_S - 0.2, f"declared hung after {min(delays):.2f}s"
        assert server.ready() == 503
    finally:
        os.kill(restarted, signal.SIGCONT)
    for thread in whole_threads:
        thread.join(300)
    assert [r.status_code for r in whole] == [200], [r.text for r in whole]
    assert whole[0].json()["choices"][0]["message"] == long_expected
    _wait_for("/ready after SIGCONT", lambda: server.ready() == 200, 60)
    assert server.engine_pid() == restarted  # resumed, not replaced
    print(f"SIGSTOP: stream errors {min(delays):.3f}-{max(delays):.3f}s after the stop")
    record_property("stop_to_stream_error_max_s", round(max(delays), 3))


def test_fail_fast_answers_503_with_retry_after(tmp_path: Path, servers: list[Server]) -> None:
    server = Server(tmp_path, "--fail-fast")
    servers.append(server)
    engine = server.engine_pid()
    whole, whole_threads = _start_whole(server, COLORS[0], WHOLE)
    _wait_for("every request in P1", lambda: server.in_flight() == WHOLE)
    killed = time.monotonic()
    os.kill(engine, signal.SIGKILL)
    for thread in whole_threads:
        thread.join(60)
    answered = time.monotonic() - killed
    during = server.whole(COLORS[2])  # a new request during the restart
    not_ready = server.ready()
    for response in [*whole, during]:
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "engine_unavailable" and error["retryable"] is True, error
        assert error["type"] == "service_unavailable_error"
        assert int(response.headers["retry-after"]) >= 1
    assert len(whole) == WHOLE and answered <= DEADLINE_S, f"503s took {answered:.2f}s"
    assert not_ready == 503
    # the restart itself (and /ready coming back) is the healing test's; not waited for here
    print(f"\nfail-fast: {WHOLE} in-flight 503s within {answered:.3f}s of the kill")
