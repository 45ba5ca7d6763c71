"""Issue 41, item 7: a pod's termination cut off long requests.

What happened: on pod deletion the front end drained for up to 30 s while the engine's preStop
slept only 5 s longer than the front end's, so the engine stopped under a 3,800-token request
("engine lost"); 32 s later uvicorn's drain deadline cancelled the request, which answered a
plain-text ``500 Internal Server Error`` (a stream: a cut connection).

Here the pod's termination is replayed with real processes (one ``mmis engine`` and one
``mmis frontend --drain-lock FILE``, the tiny model) in kubelet's order: the engine
container's preStop (``mmis wait-frontend --lock FILE``) runs while the front end gets SIGTERM,
and the engine gets SIGTERM only once its preStop returned. Then:

- a long whole request that fits the drain grace (it needs more than the old 5 s) ends 200
  with its full length;
- a whole request that cannot fit ends with the retryable 503 JSON ``server_shutting_down``
  and ``Retry-After``; a stream that cannot fit ends with the retryable SSE error event and
  ``[DONE]``: never a plain-text 500, never a cut connection;
- a request sent after SIGTERM on a connection kept alive from before it gets that 503 (with
  ``Connection: close``), guaranteed while P0 still drains in-flight work; the probes answer
  throughout (``/health`` 200, ``/ready`` 503 ``draining``);
- the preStop returns only after P0 exited, and the engine outlives P0.

The lock's own rules (several front ends, a missing file, the timeout, no torch on start-up)
are tested on ``mmis wait-frontend`` with processes that only hold the lock.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from procs import MMIS, Engine, Frontend, wait_for

GRACE_S = 20.0  # the front end's --graceful-shutdown-s here: it ends late work at GRACE_S - 1
# how long the fitting request decodes after SIGTERM at the rate measured just before: more
# than the old order's 5 s, and a third of the grace (the rate may drop on a busy machine)
FITS_S = 6.0
# a tiny model with a 32k context: its longest request decodes for minutes, never within the
# grace however fast the machine (the tiny LLaVA's 4k could, on a quiet one)
FAMILY = "qwen2-vl-hub"
SHUTTING_DOWN = "server_shutting_down"


def wait_frontend(lock: Path, timeout_s: float) -> subprocess.Popen[str]:
    """The engine container's preStop hook, as the operator renders it."""
    cmd = [*MMIS, "wait-frontend", "--lock", str(lock), "--timeout-s", f"{timeout_s:g}"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def hold_lock(lock: Path) -> subprocess.Popen[str]:
    """A process holding the drain lock as ``mmis frontend`` does, until its stdin closes."""
    code = (
        "import sys; from mmis.entrypoints.frontend import hold_drain_lock; "
        f"hold_drain_lock({str(lock)!r}); print('held', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def release(holder: subprocess.Popen[str]) -> None:
    assert holder.stdin is not None
    holder.stdin.close()
    assert holder.wait(30) == 0


def finished(proc: subprocess.Popen[str], timeout: float) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


# ------------------------------------------------------------------ mmis wait-frontend alone
def test_wait_frontend_without_a_lock_file_returns_at_once(tmp_path: Path) -> None:
    started = time.monotonic()
    out = finished(wait_frontend(tmp_path / "lock", 60), 30)
    assert "no front end" in out and time.monotonic() - started < 30
    assert not (tmp_path / "lock").exists()  # never created by the waiter


def test_wait_frontend_waits_for_every_holder(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    first, second = hold_lock(lock), hold_lock(lock)  # two front ends share the lock
    waiter = wait_frontend(lock, 120)
    try:
        release(first)
        with pytest.raises(subprocess.TimeoutExpired):  # the second one still lives
            waiter.wait(1.0)
        release(second)
        assert "every front end has exited" in finished(waiter, 30)
    finally:
        for proc in (first, second, waiter):
            proc.kill()
            proc.wait()


def test_wait_frontend_gives_up_with_status_0(tmp_path: Path) -> None:
    holder = hold_lock(tmp_path / "lock")
    try:
        out = finished(wait_frontend(tmp_path / "lock", 0.5), 30)
        assert "gave up after 0.5s" in out  # a preStop that fails would only delay the stop
    finally:
        release(holder)


def test_wait_frontend_starts_without_torch() -> None:
    """It runs as a preStop in the engine's image: the standard library only, no torch."""
    code = (
        "import sys; from mmis.cli import main; "
        "main(['wait-frontend', '--lock', '/nonexistent/lock', '--timeout-s', '1']); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy', 'uvicorn'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[-1] == "[]", out.stdout


# ------------------------------------------------------------------ a pod's termination
def _rate(stream: Stream, window_s: float = 2.0) -> float:
    """The stream's tokens per second over the next ``window_s``."""
    counted, since = stream.tokens, time.monotonic()
    time.sleep(window_s)  # a measurement window, not a synchronisation
    return (stream.tokens - counted) / (time.monotonic() - since)


class Pod:
    """One engine and one front end holding ``lock``, as the operator's pod runs them."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.lock = tmp / "frontend-drain.lock"
        from mmis.tiny_models.tiny_model import tiny_model_dir

        model = tiny_model_dir(FAMILY)
        self.engine = Engine("engine", model, tmp)
        self.frontend = Frontend(
            "frontend",
            model,
            self.engine,
            tmp,
            "--drain-lock",
            str(self.lock),
            "--graceful-shutdown-s",
            f"{GRACE_S:g}",
        )
        self.url = self.frontend.base_url

    def close(self) -> None:
        for proc in (self.frontend, self.engine):
            proc.stop(signal.SIGKILL)

    def in_flight(self) -> float:
        return self.frontend.metric("engine_requests_in_flight")


@pytest.fixture
def pod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pod]:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # steadier decoding on a shared machine
    pod = Pod(tmp_path)
    try:
        yield pod
    finally:
        pod.close()


def _chat(max_tokens: int) -> dict[str, Any]:
    """A text chat request decoding exactly ``max_tokens`` tokens (EOS ignored)."""
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


class Whole(threading.Thread):
    """A whole chat request on its own connection; :attr:`response` or :attr:`error`."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.response: httpx.Response | None = None
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            self.response = httpx.post(self.url + "/chat/completions", json=self.body, timeout=300)
        except Exception as exc:  # a cut connection: reported by the assertions
            self.error = exc

    def outcome(self) -> str:
        self.join(300)
        if self.response is None:
            return f"no response: {self.error!r}"
        r = self.response
        return f"{r.status_code} {r.headers.get('content-type')} {r.text[-300:]!r}"


class Stream(threading.Thread):
    """A streamed chat request; its SSE ``data:`` payloads as they arrive, and how many tokens
    they carried (one logprob row each): the decode clock of every request batched with it."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, {**body, "stream": True, "logprobs": True}
        self.events: list[str] = []
        self.tokens = 0
        self.status: int | None = None
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream(
                "POST", self.url + "/chat/completions", json=self.body, timeout=300
            ) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line.removeprefix("data: "))
                        self.tokens += _tokens(self.events[-1])
        except Exception as exc:  # a cut stream: reported by the assertions
            self.error = exc


def _tokens(event: str) -> int:
    if not event.startswith("{"):
        return 0
    choices = json.loads(event).get("choices") or [{}]
    return len((choices[0].get("logprobs") or {}).get("content") or [])


def _is_retryable_503(r: httpx.Response) -> None:
    assert r.status_code == 503, (r.status_code, r.text)
    assert r.headers["content-type"] == "application/json", r.headers
    error = r.json()["error"]
    assert (error["code"], error["retryable"]) == (SHUTTING_DOWN, True), error
    assert int(r.headers["retry-after"]) >= 1


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pod_termination_drains_p0_before_the_engine_stops(pod: Pod) -> None:
    pod.frontend.wait_ready()
    assert pod.lock.exists()  # held from P0's start
    card = httpx.get(pod.url + "/models", timeout=30).json()["data"][0]
    longest = int(card["max_model_len"]) - 64  # room for the prompt: the most decode there is

    # too long for the grace: tens of thousands of tokens
    stream = Stream(pod.url, _chat(longest))
    late = Whole(pod.url, _chat(longest))
    wait_for("the stream's first tokens", lambda: stream.tokens >= 20, 120)
    # the request that fits: sized for about twice FITS_S of decode at the rate seen so far
    fits_tokens = max(200, int(_rate(stream) * FITS_S * 2))
    fits = Whole(pod.url, _chat(fits_tokens))
    # a connection kept alive across SIGTERM: each response's local address, read while open
    local: list[tuple[str, int]] = []

    def where(response: httpx.Response) -> None:
        local.append(response.extensions["network_stream"].get_extra_info("client_addr"))

    keep = httpx.Client(base_url=pod.url, timeout=60, event_hooks={"response": [where]})
    wait_for("all three requests in P1", lambda: pod.in_flight() >= 3, 60)
    joined = stream.tokens  # the batch decodes in lock-step: one token per request per step
    # SIGTERM when `fits` has FITS_S of decode left at the rate of all three together
    left = int(_rate(stream) * FITS_S)
    signal_at = joined + fits_tokens - left
    wait_for("the moment to stop the pod", lambda: stream.tokens >= signal_at, 120)
    assert stream.error is None and late.response is None and fits.response is None
    clock = (fits_tokens, joined, left, stream.tokens)  # for the messages below

    assert keep.get("/models").status_code == 200  # within uvicorn's 5 s keep-alive

    # kubelet: the engine's preStop and the front end's SIGTERM at once (no preStop pause
    # on the front end here), the engine's SIGTERM only after its preStop returned
    prestop = wait_frontend(pod.lock, GRACE_S + 10)
    pod.frontend.popen.send_signal(signal.SIGTERM)
    signalled = time.monotonic()

    # a new request on the kept-alive connection, sent after the signal: P0 still drains
    again = keep.post("/chat/completions", json=_chat(4))
    _is_retryable_503(again)
    assert again.headers.get("connection") == "close"
    assert local[0] == local[1], local  # the same connection as before the signal
    assert httpx.get(pod.frontend.root_url + "/health", timeout=5).status_code == 200
    ready = httpx.get(pod.frontend.root_url + "/ready", timeout=5)
    assert (ready.status_code, ready.json()) == (503, {"status": "draining"})

    out = finished(prestop, GRACE_S + 30)
    waited = time.monotonic() - signalled
    assert "every front end has exited" in out, out
    assert pod.frontend.popen.wait(5) == 0, pod.frontend.log_tail()  # exited, lock released
    assert pod.engine.popen.poll() is None, "the engine did not outlive P0"
    pod.engine.popen.send_signal(signal.SIGTERM)
    assert pod.engine.popen.wait(60) == 0, pod.engine.log_tail()
    keep.close()

    # the request that fits: whole, 200, every token
    assert fits.response is not None, fits.outcome()
    assert fits.response.status_code == 200, (fits.outcome(), clock)
    usage, choice = fits.response.json()["usage"], fits.response.json()["choices"][0]
    assert (usage["completion_tokens"], choice["finish_reason"]) == (fits_tokens, "length")
    # the whole request that cannot fit: the retryable 503 JSON, never uvicorn's plain 500
    assert late.response is not None, late.outcome()
    _is_retryable_503(late.response)
    # the stream that cannot fit: tokens, then the retryable error event and [DONE]
    stream.join(60)
    assert stream.error is None and stream.status == 200, (stream.error, stream.events[-3:])
    assert stream.events[-1] == "[DONE]", stream.events[-3:]
    error = json.loads(stream.events[-2])["error"]
    assert (error["code"], error["retryable"]) == (SHUTTING_DOWN, True), error
    assert stream.tokens > clock[3]  # it decoded on while P0 drained
    # P0 ended the late work itself, a moment before its grace ran out, then exited
    assert GRACE_S - 2 <= waited <= GRACE_S + 10, waited
    assert "Exception in ASGI application" not in pod.frontend.log_path.read_text()
    print(
        f"\ndrain: preStop returned {waited:.1f}s after SIGTERM; (fits, joined, left, at) {clock}"
    )
    assert os.path.exists(pod.lock)  # kept: the next front end of the pod takes it again
