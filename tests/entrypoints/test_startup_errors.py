"""The start-up errors a newcomer meets (issue 48 item 4), each met by a real ``mmis serve``.

Each case starts ``mmis serve --port 0`` into one error and checks what the user sees: exit
status 1, a last stderr line ``mmis serve: ...`` that names the cause and the fix (the words
of both are asserted), no ``Traceback`` anywhere on stderr, an exit within the bound, and no
process left behind (every process of the run carries a marker in its environment; none may
hold it after the exit) and no ``mmis-*`` directory left in a private ``TMPDIR`` (serve's
IPC directory removed).

- Found by ``mmis serve`` itself before any child starts or any port is bound
  (``entrypoints/serve.py`` ``preflight``): a model path that does not exist, a hub id the
  hub does not know (a local HTTP server answering as the Hub does, ``HF_ENDPOINT``), a hub
  that cannot be reached (a closed port), a hub id missing from the cache under
  ``HF_HUB_OFFLINE``, a port in use, a ``TMPDIR`` too long for P1's IPC socket paths, a
  ``--shm-dir`` with less room than ``--shm-gb``. These run concurrently (each well under a
  second alone); the bound is 15 s.
- Found by P1 and relayed (``entrypoints/engine.py``, ``engine/builder.py``): ``--device
  cuda`` where torch sees no GPU (skipped where one is present), a model family not
  supported, a KV cache that cannot hold one request of ``--max-model-len``. These pay the
  engine's imports and model load, one after the other; the bound is 15 s, or on a machine
  too loaded for that five times a cold import of the model stack (as
  ``tests/e2e/test_serve.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mmis.tiny_models.tiny_model import tiny_model_dir

MMIS = [str(Path(sys.executable).parent / "mmis")]
BOUND_S = 15.0  # issue 48: seconds from `mmis serve` to its exit, a behaviour bound
MARK = "MMIS_TEST_STARTUP_ERROR_RUN"
RUN_TIMEOUT_S = 150  # a serve that never exits (the old behaviour of some cases) fails here


@dataclasses.dataclass
class Outcome:
    code: int
    took: float
    last: str
    stderr: str
    leftover: list[int]  # pids still carrying the run's marker after the exit
    tmp_left: list[str]


def _marked(mark: str) -> list[int]:
    found = []
    needle = f"{MARK}={mark}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def serve_into(*flags: str, env: dict[str, str] | None = None, tmpdir: str = "/tmp") -> Outcome:
    """``mmis serve --port 0 FLAGS`` to its exit, offline unless ``env`` says otherwise,
    with a private ``TMPDIR`` made in ``tmpdir`` (short: P1's IPC sockets are made there)."""
    mark = uuid.uuid4().hex
    private = Path(tempfile.mkdtemp(prefix="mmis-se-", dir=tmpdir))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MMIS_", "HF_"))}
    run_env = {**base, "HF_HUB_OFFLINE": "1", "TMPDIR": str(private), MARK: mark, **(env or {})}
    run_env = {k: v for k, v in run_env.items() if v}  # an empty value: unset
    t0 = time.monotonic()
    try:
        done = subprocess.run(
            [*MMIS, "serve", "--port", "0", *flags],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            env=run_env,
        )
        code, stderr = done.returncode, done.stderr
    except subprocess.TimeoutExpired as exc:  # killed: P1 gets SIGTERM from the kernel
        part = exc.stderr or ""
        code = -9
        stderr = (part.decode(errors="replace") if isinstance(part, bytes) else part) + (
            f"\n(no exit within {RUN_TIMEOUT_S}s)"
        )
    took = time.monotonic() - t0
    lines = [line for line in stderr.splitlines() if line.strip()]
    leftover = [pid for pid in _marked(mark) if pid != os.getpid()]
    left = sorted(p.name for p in private.iterdir() if p.name.startswith("mmis-"))  # ours
    shutil.rmtree(private)
    return Outcome(code, took, lines[-1] if lines else "", stderr, leftover, left)


def check(name: str, out: Outcome, words: tuple[str, ...], bound: float) -> list[str]:
    """What is wrong with ``out`` (empty: nothing)."""
    wrong = []
    if out.code != 1:
        wrong.append(f"exit {out.code}, not 1")
    if not out.last.startswith("mmis serve: ") or any(w not in out.last for w in words):
        wrong.append(f"last line {out.last!r} lacks {words}")
    if "Traceback" in out.stderr:
        wrong.append("a Traceback on stderr")
    if out.took >= bound:
        wrong.append(f"{out.took:.1f}s to exit, bound {bound:.1f}s")
    if out.leftover:
        wrong.append(f"processes left behind: {out.leftover}")
    if out.tmp_left:
        wrong.append(f"left in TMPDIR: {out.tmp_left}")
    print(f"{name}: exit {out.code} in {out.took:.1f}s: {out.last}")
    return [f"{name}: {w}\n{out.stderr[-1500:]}" for w in wrong]


class _Hub(BaseHTTPRequestHandler):
    """The Hub's answer for a repository it does not have (huggingface_hub reads the code)."""

    def do_HEAD(self) -> None:
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def hub() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_errors_found_before_anything_starts(tmp_path: Path, hub: str) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = str(taken.getsockname()[1])
    long_dir = tmp_path / ("d" * 90)
    long_dir.mkdir()
    online = {"HF_HUB_OFFLINE": ""}
    cases = {
        "missing path": (
            [f"--model={tmp_path}/no-such-model"],
            {},
            ("does not exist", "pass a model directory"),
        ),
        "hub id not found": (
            ["--model", "acme/no-such-model"],
            {**online, "HF_ENDPOINT": hub},
            ("acme/no-such-model not found", "check the id"),
        ),
        "hub unreachable": (
            ["--model", "acme/no-such-model"],
            {**online, "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"},
            ("could not reach", "pass a local path", "HF_HUB_OFFLINE"),
        ),
        "hub offline, not cached": (
            ["--model", "acme/no-such-model"],
            {"HF_HOME": str(tmp_path / "hf")},
            ("not in the local cache", "HF_HUB_OFFLINE is set", "hf download"),
        ),
        "port in use": (
            ["--port", port],
            {},
            (f"port {port}", "in use", "pick another with --port"),
        ),
        "TMPDIR too long for a unix socket": (
            [],
            {"TMPDIR": str(long_dir)},
            ("too long for the engine's unix sockets", "set TMPDIR to a shorter directory"),
        ),
        "shm too small": (
            ["--mm-cache-type", "shm", "--shm-dir", str(tmp_path), "--shm-gb", "1000000"],
            {},
            ("too small for --shm-gb 1e+06", "lower --shm-gb", "--shm-size"),
        ),
    }
    try:
        with ThreadPoolExecutor(len(cases)) as pool:
            runs = {
                name: pool.submit(serve_into, *flags, env=env)
                for name, (flags, env, _) in cases.items()
            }
            wrong = [
                w
                for name, run in runs.items()
                for w in check(name, run.result(), cases[name][2], BOUND_S)
            ]
    finally:
        taken.close()
    assert not wrong, "\n".join(wrong)


def loaded_bound() -> float:
    """15 s, or on a machine too loaded for that five times a cold import of the model stack
    (what P1 pays before it can fail); the issue's 15 s holds on a quiet machine. Measured
    only for a case that took longer than 15 s."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch, transformers.modeling_utils"], check=True)
    return max(BOUND_S, 5 * (time.monotonic() - t0))


@pytest.mark.model
@pytest.mark.slow
def test_errors_found_by_the_engine_are_relayed_in_one_line(tmp_path: Path) -> None:
    import torch

    tiny = tiny_model_dir("llava")
    family = tmp_path / "unsupported-family"
    family.mkdir()
    for item in tiny.iterdir():  # the same files, a family mmis does not run
        if item.name != "config.json":
            (family / item.name).symlink_to(item)
    config = json.loads((tiny / "config.json").read_text())
    config.update(model_type="mllama", architectures=["MllamaForConditionalGeneration"])
    (family / "config.json").write_text(json.dumps(config))
    cases: dict[str, tuple[list[str], tuple[str, ...]]] = {
        "unsupported family": (
            ["--model", str(family)],
            ("model_type 'mllama' is not supported", "serve a model of a supported family"),
        ),
        "no KV room for one max_model_len request": (
            [
                *("--model", str(tiny), "--kv-cache-gb", "0.0001", "--max-model-len", "4096"),
                *("--encoder-cache-tokens", "64"),  # no image probe before the pool is sized
            ],
            ("one request of --max-model-len 4096 needs 257", "raise --kv-cache-gb"),
        ),
    }
    if not torch.cuda.is_available():
        cases["--device cuda without a GPU"] = (
            ["--model", str(tiny), "--device", "cuda"],
            ("torch sees no CUDA device", "drop --device"),
        )
    wrong = []
    for name, (flags, words) in cases.items():  # one at a time: each loads torch and the model
        out = serve_into(*flags)
        bound = BOUND_S if out.took < BOUND_S else loaded_bound()
        wrong += check(name, out, ("the engine failed to start: ", *words), bound)
        if out.stderr.count(words[0]) != 1:
            wrong.append(f"{name}: the cause is said {out.stderr.count(words[0])} times, not once")
    shutil.rmtree(family)
    assert not wrong, "\n".join(wrong)
