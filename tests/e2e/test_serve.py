"""``mmis serve`` as a user runs it: one real process (P0 in it, P1 its child), the openai SDK.

- A fresh install (empty ``MMIS_MODEL_CACHE``) with no model arguments builds the tiny model,
  serves ``mmis-tiny`` and answers a chat request with an image; the time from process start
  to the first 200 is printed and recorded (``start_to_first_200_s``), not asserted.
- SIGTERM while requests are in flight (one streaming, one not): both complete with the
  drift-free output, the process exits 0, the engine child is gone and the private IPC
  directory is removed.
- P1 SIGKILLed under serve: serve restarts it, the next requests get 200 with identical
  output (the cache epoch change heals the drift); SIGKILL of serve itself takes P1 with it.

Waits are bounded polls of another process's observable state (its children, ``/metrics``),
never sleeps standing in for synchronisation.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from procs import MMIS, Proc, children, image_url, running, wait_for

from mmis.tiny_models.tiny_model import tiny_model_dir

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(600)]

COLORS = [(200, 10, 10), (10, 200, 10), (10, 10, 200), (120, 120, 0)]
# tokens, EOS ignored: seconds of decoding, so both are still in P1 at the signal (sent once
# the gauge shows both; 2000 before, three times the decoding for the same proof)
LONG = 1000


class Serve(Proc):
    """``mmis serve --port 0`` plus an openai client on it."""

    def __init__(self, log_dir: Path, *extra: str) -> None:
        super().__init__("serve", ["serve", "--port", "0", *extra], log_dir, announces=True)
        self.engines: set[int] = set()  # every engine pid seen, killed in teardown if alive
        self.client = openai.OpenAI(
            base_url=self.root_url + "/v1", api_key="unused", timeout=300, max_retries=0
        )

    def chat(self, color: tuple[int, int, int], max_tokens: int = 8) -> tuple[str, str]:
        response = self.client.chat.completions.create(
            model="mmis-tiny",
            max_tokens=max_tokens,
            temperature=0,
            messages=[{"role": "user", "content": _content(color)}],  # type: ignore[misc,list-item]
            extra_body={"ignore_eos": True},
        )
        choice = response.choices[0]
        return choice.message.content or "", str(choice.finish_reason)

    def engine_pid(self, not_pid: int | None = None, timeout: float = 120.0) -> int:
        """The one engine child (waits until there is one other than ``not_pid``)."""
        found: list[int] = []

        def one() -> bool:
            found[:] = [p for p in children(self.popen.pid) if p != not_pid]
            return len(found) == 1

        wait_for("the engine child of serve", one, timeout)
        self.engines.add(found[0])
        return found[0]

    def gauge(self, name: str) -> float:
        """The unlabelled P0 series ``mmis_frontend_<name>`` on ``/metrics``."""
        for line in httpx.get(self.root_url + "/metrics", timeout=30).text.splitlines():
            if line.startswith(f"mmis_frontend_{name} "):
                return float(line.split()[1])
        raise KeyError(name)


def _content(color: tuple[int, int, int]) -> list[dict[str, object]]:
    return [
        {"type": "image_url", "image_url": {"url": image_url(color)}},
        {"type": "text", "text": "What is in the picture?"},
    ]


@pytest.fixture
def serve_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh model cache and a private TMPDIR (where serve's IPC directory must appear)."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("MMIS_MODEL_CACHE", str(tmp_path / "models"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    return tmp_path


@pytest.fixture
def started(serve_env: Path) -> Iterator[list[Serve]]:
    procs: list[Serve] = []
    yield procs
    for proc in procs:
        proc.stop(signal.SIGKILL)
        for pid in proc.engines:
            if running(pid):  # only after a failure: never leave an engine behind
                os.kill(pid, signal.SIGKILL)


def test_fresh_install_serves_then_drains_on_sigterm(
    serve_env: Path, started: list[Serve], record_property: Callable[[str, object], None]
) -> None:
    assert not (serve_env / "models").exists()
    # no model arguments; a drain bound that two LONG decodes fit even on a crowded machine
    # (the default 30 s is not what this test is about: that in-flight requests complete)
    serve = Serve(serve_env, "--graceful-shutdown-s", "300")
    started.append(serve)
    text, _ = serve.chat(COLORS[0])  # waits in the accept queue until P0 and P1 are up
    elapsed = time.monotonic() - serve.started_at
    record_property("start_to_first_200_s", round(elapsed, 1))
    print(f"\nmmis serve (fresh install): start to first 200 in {elapsed:.1f}s")
    assert text
    assert (serve_env / "models" / "mmis-tiny-llava" / "config.json").exists()
    (card,) = serve.client.models.list().data
    assert card.id == "mmis-tiny"
    # the dtype P1 computes in, as its start-up log names it (--dtype auto: CPU-dependent)
    dtype = (card.model_extra or {}).get("dtype")
    assert dtype in ("float32", "bfloat16"), card
    assert f"on cpu in {dtype}" in serve.log_path.read_text(), serve.log_tail()
    engine = serve.engine_pid()
    (ipc_dir,) = (serve_env / "tmp").glob("mmis-serve-*")

    expected = serve.chat(COLORS[1], max_tokens=LONG)
    assert expected[1] == "length"  # EOS ignored: the full LONG tokens
    results: list[tuple[str, str]] = []
    worker = threading.Thread(target=lambda: results.append(serve.chat(COLORS[1], LONG)))
    worker.start()
    stream = serve.client.chat.completions.create(
        model="mmis-tiny",
        max_tokens=LONG,
        temperature=0,
        stream=True,
        messages=[{"role": "user", "content": _content(COLORS[1])}],  # type: ignore[misc,list-item]
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    first = next(chunks)
    wait_for("both requests in P1", lambda: serve.gauge("engine_requests_in_flight") == 2)
    serve.popen.send_signal(signal.SIGTERM)

    streamed, finish = "", None
    for chunk in [first, *chunks]:
        if chunk.choices:
            streamed += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    worker.join(300)
    assert (streamed, str(finish)) == expected
    assert results == [expected]
    assert serve.popen.wait(120) == 0, serve.log_tail()
    assert not running(engine), f"engine child {engine} outlived serve"
    assert not ipc_dir.exists(), f"{ipc_dir} was not removed"


def test_engine_killed_under_serve_is_restarted(serve_env: Path, started: list[Serve]) -> None:
    serve = Serve(serve_env)
    started.append(serve)
    expected = {color: serve.chat(color) for color in COLORS}
    engine = serve.engine_pid()

    os.kill(engine, signal.SIGKILL)
    wait_for("the killed engine reaped", lambda: not running(engine))
    restarted = serve.engine_pid(not_pid=engine)
    for color in COLORS:
        assert serve.chat(color) == expected[color]
    assert serve.gauge("epoch_changes_total") == 1  # P0 noticed the restart, exactly once
    assert serve.popen.poll() is None

    # serve killed without any chance to clean up: the kernel stops its engine for it
    serve.popen.kill()
    serve.popen.wait(30)
    wait_for("the engine of a SIGKILLed serve to exit", lambda: not running(restarted), 60)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--fault-evict-rate", "2"], "--fault-evict-rate must be within [0, 1]"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be at least 1"),
    ],
)
def test_bad_engine_flags_exit_2_before_anything_starts(
    serve_env: Path, flags: list[str], message: str
) -> None:
    done = subprocess.run(
        [*MMIS, "serve", "--port", "0", *flags], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert done.stdout == ""  # never listened
    assert not (serve_env / "models").exists()  # no model built, no engine started
    assert not list((serve_env / "tmp").iterdir())


# -- a start that cannot succeed ends at once, saying why -----------------------------------
START_FAILS_WITHIN_S = 15.0  # issue 30: seconds from `mmis serve` to its exit


@pytest.fixture(scope="module")
def start_bound() -> float:
    """15 s, or on a machine too loaded for that five times a cold import of the model stack
    (what a start pays before it can fail); the issue's 15 s holds on a quiet machine."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch, transformers.modeling_utils"], check=True)
    return max(START_FAILS_WITHIN_S, 5 * (time.monotonic() - t0))


def _serve_until_exit(model: Path, env: dict[str, str]) -> tuple[int, float, str, str]:
    t0 = time.monotonic()
    done = subprocess.run(
        [*MMIS, "serve", "--port", "0", "--model", str(model)],
        capture_output=True,
        text=True,
        timeout=300,  # the old behaviour: ~7 engine restarts, then P0's 120 s handshake bound
        env={**os.environ, **env},
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return done.returncode, time.monotonic() - t0, lines[-1] if lines else "", done.stderr


def test_missing_runtime_dependency_fails_fast_with_the_cause(
    serve_env: Path, tmp_path: Path, start_bound: float
) -> None:
    """As if accelerate were not installed (the bug of issue 30: the engine's from_pretrained
    needs it): the import system is told it is absent, for serve and its engine child."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text('import sys\nsys.modules["accelerate"] = None\n')
    code, took, last, err = _serve_until_exit(tiny_model_dir("llava"), {"PYTHONPATH": str(hide)})
    print(f"\nmissing dependency: exit {code} in {took:.1f}s (bound {start_bound:.1f}s)")
    assert code == 1, err[-3000:]
    assert last.startswith("mmis serve: the engine failed to start: "), err[-3000:]
    assert "requires `accelerate`" in last, last
    assert "0 restarts" in err  # a failed start is not retried as a crash
    assert took < start_bound, f"{took:.1f}s to exit, bound {start_bound:.1f}s"
