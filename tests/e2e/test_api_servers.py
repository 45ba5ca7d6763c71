"""``--api-servers N``: N P0 processes behind one port, end to end (issue 45, item 1).

One module-scoped ``mmis serve --api-servers 2 --ops-port 0`` on the tiny LLaVA (float32, one
OpenMP thread) and the session's one-process ``tiny_serve`` for comparison; the openai SDK,
one fresh connection per request (each connection is accepted by whichever process is free).

- Image chats spread over both processes, by their ``mmis_requests_total{api_server}`` on the
  operations port; that one ``/metrics`` counts every request of both, shows P1's figures
  once, and ``/stats/cache`` sums both drift windows (its request count is the total, which
  neither process saw alone).
- Greedy outputs equal those of ``--api-servers 1``.
- SIGKILL of one process under load: it is restarted (logged with its index, counted in
  ``mmis_frontend_api_server_restarts_total``), a request it held ends with a connection
  error that succeeds on the client's retry, every other request succeeds, the other process
  keeps its pid and keeps serving.
- SIGTERM drains both (streams in flight on each finish whole) and serve exits 0, leaving
  no process.
- Without a server of this module: a P1 that cannot load still ends serve with exit 1 and
  its cause within seconds; ``mmis frontend --api-servers 2`` whose engine never answers
  exits 1 with one ``failed to start`` line and one listening line; a SIGKILLed supervisor
  leaves no child (parent-death signal).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import ONE_THREAD
from procs import MMIS, Proc, ServeFactory, children, image_url, openai_client, running, wait_for

from mmis.tiny_models.tiny_model import tiny_model_dir

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(600)]

OPS_LINE = re.compile(r"mmis frontend operations on (http://\S+)")
CHILD = "mmis.entrypoints.api_servers"  # in each child's command line
DRAIN_S = 120  # --graceful-shutdown-s: the streams in flight at SIGTERM finish within it
# tokens a drained stream decodes (EOS ignored): each is still decoding when both processes
# hold one and the signal goes (3000 before: the same proof, 2.5x the decoding)
LONG = 1200
READY_LINE = "ready: a synthetic image request went through"  # each P0 logs it once


class Group:
    """The module's server: its public URL, its operations URL, its processes."""

    def __init__(self, proc: Proc) -> None:
        self.proc = proc
        self.ops = ""

        def announced() -> bool:
            match = OPS_LINE.search(proc.log_path.read_text(errors="replace"))
            self.ops = match.group(1) if match else ""
            return bool(match)

        wait_for("the operations line", announced, 30)

    def scrape(self) -> str:
        answer = httpx.get(self.ops + "/metrics", timeout=30)
        answer.raise_for_status()
        return answer.text

    def by_index(self, name: str, text: str | None = None) -> dict[str, float]:
        """``name``'s samples summed per ``api_server`` label ("" for none)."""
        totals: dict[str, float] = {}
        for line in (self.scrape() if text is None else text).splitlines():
            sample, _, value = line.rpartition(" ")
            if sample.split("{")[0] != name:
                continue
            match = re.search(r'api_server="(\d+)"', sample)
            key = match.group(1) if match else ""
            totals[key] = totals.get(key, 0.0) + float(value)
        return totals

    def cache_stats(self) -> dict[str, float]:
        answer = httpx.get(self.ops + "/stats/cache", timeout=30)
        answer.raise_for_status()
        stats: dict[str, float] = answer.json()
        return stats

    def p0_pids(self) -> list[int]:
        return sorted(pid for pid in children(self.proc.popen.pid) if CHILD in _cmdline(pid))


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.fixture(scope="module")
def group(start_serve: ServeFactory) -> Iterator[Group]:
    flags = ["--model", str(tiny_model_dir()), "--served-model-name", "tiny"]
    flags += ["--graceful-shutdown-s", str(DRAIN_S)]
    with start_serve(
        "serve-api-servers", *flags, "--api-servers", "2", "--ops-port", "0", env=ONE_THREAD
    ) as proc:
        server = Group(proc)
        log = proc.log_path
        wait_for("both processes ready", lambda: log.read_text().count(READY_LINE) == 2, 120)
        yield server


def _messages(color: tuple[int, int, int]) -> list[dict[str, object]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_url(color)}},
                {"type": "text", "text": "What is in the picture?"},
            ],
        }
    ]


def _chat(proc: Proc, color: tuple[int, int, int], max_tokens: int = 8) -> str:
    """One greedy image chat on a fresh connection; its text."""
    with openai_client(proc) as client:
        answer = client.chat.completions.create(
            model="tiny",
            messages=_messages(color),
            max_tokens=max_tokens,
            temperature=0,  # type: ignore[arg-type]
        )
    return answer.choices[0].message.content or ""


def _colors(n: int, seed: int) -> list[tuple[int, int, int]]:
    return [((seed * 37 + i * 53) % 256, (i * 97) % 256, (seed + i * 11) % 256) for i in range(n)]


# -- spread, counted once, summed ---------------------------------------------------------------
def test_chats_spread_over_both_and_the_ops_port_answers_for_both(group: Group) -> None:
    sent = 24
    before = group.by_index("mmis_requests_total")
    window_before = group.cache_stats()["requests"]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda c: _chat(group.proc, c), _colors(sent, 1)))
    text = group.scrape()
    after = group.by_index("mmis_requests_total", text)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    print(f"\nrequests per process: {delta}")
    assert set(delta) == {"0", "1"}, delta  # every P0 series carries its process index
    assert delta["0"] > 0 and delta["1"] > 0, delta  # both processes served chats
    assert sum(delta.values()) == sent  # one /metrics counts every process's requests
    assert group.by_index("mmis_engine_up", text) == {"": 1.0}  # P1's figures once
    assert group.by_index("mmis:num_requests_running", text).keys() == {""}
    assert group.by_index("mmis_frontend_api_server_restarts_total", text) == {"0": 0, "1": 0}
    # the drift window of both: the requests neither process saw alone
    assert group.cache_stats()["requests"] - window_before == sent


def test_greedy_outputs_equal_one_process(group: Group, tiny_serve: Proc) -> None:
    colors = _colors(4, 2) + _colors(2, 2)  # the repeats: shadow hits in whichever process
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        two = list(pool.map(lambda c: _chat(group.proc, c, 12), colors))
    one = [_chat(tiny_serve, c, 12) for c in colors]
    assert two == one


def _uuid_chat(proc: Proc, uuid: str, color: tuple[int, int, int] | None) -> str:
    """A greedy chat naming its image by ``uuid``, with the data (``color``) or by uuid alone."""
    inner: dict[str, object] = {"uuid": uuid}
    if color is not None:
        inner["url"] = image_url(color)
    part = {"type": "image_url", "image_url": inner}
    with openai_client(proc) as client:
        answer = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": [part, {"type": "text", "text": "And now?"}]}],  # type: ignore[list-item,misc]
            max_tokens=8,
            temperature=0,  # type: ignore[arg-type]
        )
    return answer.choices[0].message.content or ""


def test_a_uuid_bound_in_one_process_resolves_in_the_other(group: Group) -> None:
    """The data with its uuid lands on one process, the uuid alone on whichever accepts next:
    every uuid-only request answers (its process asks its sibling on the private socket),
    and as a shadow hit, never with a 422."""
    before = group.by_index("mmis_requests_total")
    sent = 0
    for n in range(4):
        uuid, color = f"photo-{n}", (n * 50, 200, 17)
        first = _uuid_chat(group.proc, uuid, color)
        sent += 1
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            repeats = list(pool.map(_uuid_chat, [group.proc] * 6, [uuid] * 6, [None] * 6))
        sent += 6
        assert repeats == [first] * 6
    delta = {k: v - before.get(k, 0.0) for k, v in group.by_index("mmis_requests_total").items()}
    assert sum(delta.values()) == sent and all(delta.get(k, 0) > 0 for k in ("0", "1")), delta
    # the siblings' route answers on their private sockets only, never on a port
    ask = {"tenant": "x", "modality": "image", "uuid": "photo-0"}
    for base in (group.proc.root_url, group.ops):
        assert httpx.post(base + "/sibling/uuid_binding", json=ask, timeout=30).status_code == 404


# -- one process killed under load -----------------------------------------------------------
def test_a_killed_process_is_restarted_alone_under_load(group: Group) -> None:
    pids = group.p0_pids()
    assert len(pids) == 2, pids
    victim, survivor = pids
    before = group.by_index("mmis_requests_total")
    stop = threading.Event()
    ok, healed, failed = [], [], []  # request outcomes
    lock = threading.Lock()

    def load(worker: int) -> None:
        i = 0
        while not stop.is_set():
            color = ((worker * 40 + i) % 256, i % 256, 99)
            i += 1
            try:
                _chat(group.proc, color, 16)
                outcome = ok
            except openai.APIConnectionError:  # its process died under it: retry once
                try:
                    _chat(group.proc, color, 16)
                    outcome = healed
                except openai.APIError as exc:
                    outcome = failed
                    print(f"retry failed: {exc!r}")
            except openai.APIError as exc:
                outcome = failed
                print(f"failed: {exc!r}")
            with lock:
                outcome.append(color)

    workers = [threading.Thread(target=load, args=(w,)) for w in range(4)]
    for worker in workers:
        worker.start()
    try:
        wait_for("load running", lambda: len(ok) >= 8, 120)
        os.kill(victim, signal.SIGKILL)
        killed_at = len(ok)
        log = group.proc.log_path
        exited = re.compile(rf"api server (\d) \(pid {victim}\) exited with status -9")
        wait_for("the exit logged", lambda: exited.search(log.read_text()) is not None, 30)
        index = exited.search(log.read_text()).group(1)  # type: ignore[union-attr]
        other = "1" if index == "0" else "0"
        wait_for(
            "a new process", lambda: len(group.p0_pids()) == 2 and victim not in group.p0_pids(), 60
        )
        restarts = "mmis_frontend_api_server_restarts_total"
        assert group.by_index(restarts) == {index: 1.0, other: 0.0}
        wait_for(
            "the new process ready",
            lambda: group.by_index("mmis_frontend_ready").get(index) == 1.0,
            120,
        )
        wait_for("load after the restart", lambda: len(ok) >= killed_at + 8, 120)
    finally:
        stop.set()
        for worker in workers:
            worker.join(120)
    print(f"\nok {len(ok)}, healed on retry {len(healed)}, failed {len(failed)}")
    assert not failed
    assert len(healed) <= 4  # at most the requests in flight on the killed process
    assert running(survivor) and survivor in group.p0_pids()  # the other one never stopped
    after = group.by_index("mmis_requests_total")
    assert after[other] > before[other]  # and served through it all
    assert _chat(group.proc, (1, 2, 3))  # the pair serves


# -- SIGTERM drains both --------------------------------------------------------------------
def test_sigterm_drains_both_processes_and_exits_0(group: Group) -> None:
    pids = group.p0_pids()
    results: list[str | None] = []
    lock = threading.Lock()

    def stream(color: tuple[int, int, int]) -> None:
        finish = None
        with openai_client(group.proc) as client:
            chunks = client.chat.completions.create(
                model="tiny",
                messages=_messages(color),
                max_tokens=LONG,
                temperature=0,  # type: ignore[arg-type]
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
        with lock:
            results.append(finish)

    threads: list[threading.Thread] = []

    def both_busy() -> bool:
        busy = group.by_index("mmis_frontend_engine_requests_in_flight")
        return busy.get("0", 0) > 0 and busy.get("1", 0) > 0

    def in_flight() -> float:
        return sum(group.by_index("mmis_frontend_engine_requests_in_flight").values())

    for color in _colors(16, 3):  # one at a time until each process holds one
        busy = in_flight()
        thread = threading.Thread(target=stream, args=(color,))
        thread.start()
        threads.append(thread)
        with contextlib.suppress(TimeoutError):
            wait_for("one more in flight", lambda b=busy: in_flight() > b, 10)
        if both_busy():
            break
    assert both_busy(), (group.by_index("mmis_frontend_engine_requests_in_flight"), results)
    t0 = time.monotonic()
    group.proc.popen.send_signal(signal.SIGTERM)
    code = group.proc.popen.wait(DRAIN_S + 30)
    print(f"\n{len(threads)} streams, drained in {time.monotonic() - t0:.1f}s")
    for thread in threads:
        thread.join(30)
    assert code == 0, group.proc.log_tail()
    assert results == ["length"] * len(threads)  # every stream ran to its end
    assert not [pid for pid in pids if running(pid)]
    assert "api servers stopped" in group.proc.log_path.read_text()


# -- start-up and the supervisor's death, without a server of this module --------------------
def test_a_p1_that_cannot_load_ends_serve_at_once(tmp_path: Path) -> None:
    model = tmp_path / "broken"
    shutil.copytree(tiny_model_dir("llava"), model)
    (model / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    t0 = time.monotonic()
    done = subprocess.run(
        [
            *MMIS,
            "serve",
            "--port",
            "0",
            "--model",
            str(model),
            "--api-servers",
            "2",
            "--engine-timeout-s",
            "600",
        ],
        capture_output=True,
        text=True,
        timeout=240,  # far below the children's handshake bound: only the relay ends them
        env={**os.environ, **ONE_THREAD, "HF_HUB_OFFLINE": "1"},
    )
    took = time.monotonic() - t0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    print(f"\nexit {done.returncode} in {took:.1f}s: {lines[-1] if lines else ''}")
    assert done.returncode == 1, done.stderr[-3000:]
    assert lines[-1].startswith("mmis serve: the engine failed to start: "), done.stderr[-3000:]
    assert "Error" in lines[-1].removeprefix("mmis serve: the engine failed to start: ")
    assert "0 restarts" in done.stderr  # a failed start is not retried as a crash
    assert done.stdout.count("listening on") == 1


def _frontend_without_engine(tmp_path: Path, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            *MMIS,
            "frontend",
            "--port",
            "0",
            "--model",
            str(tiny_model_dir()),
            "--api-servers",
            "2",
            "--engine-input-address",
            f"ipc://{tmp_path}/none-in",
            "--engine-output-address",
            f"ipc://{tmp_path}/none-out",
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **ONE_THREAD, "HF_HUB_OFFLINE": "1"},
    )


def test_an_engine_that_never_answers_fails_the_start_in_one_line(tmp_path: Path) -> None:
    proc = _frontend_without_engine(tmp_path, "--engine-timeout-s", "2")
    try:
        out, err = proc.communicate(timeout=240)
    finally:  # a supervisor that restarts failed starts for ever is stopped here
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 1, err[-3000:]
    assert out.splitlines()[0].startswith("mmis frontend listening on http://")
    assert len(out.splitlines()) == 1  # one listening line, not one per process
    assert lines[-1].startswith("mmis frontend: failed to start: "), err[-3000:]
    assert "did not answer within 2s" in lines[-1], lines[-1]


def test_a_sigkilled_supervisor_leaves_no_child(tmp_path: Path) -> None:
    log = tmp_path / "frontend.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(  # its children wait for an engine for 120 s
            [
                *MMIS,
                "frontend",
                "--port",
                "0",
                "--model",
                str(tiny_model_dir()),
                "--api-servers",
                "2",
                "--engine-input-address",
                f"ipc://{tmp_path}/none-in",
                "--engine-output-address",
                f"ipc://{tmp_path}/none-out",
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
            env={**os.environ, **ONE_THREAD, "HF_HUB_OFFLINE": "1"},
        )
    try:  # both children past their own start (uvicorn's start-up has begun in each)
        wait_for(
            "two children starting",
            lambda: log.read_text().count("Waiting for application startup") == 2,
            120,
        )
        kids = [p for p in children(proc.pid) if CHILD in _cmdline(p)]
        assert len(kids) == 2, kids
        proc.kill()
        proc.wait(10)
        wait_for("no child left", lambda: not [p for p in kids if running(p)], 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
