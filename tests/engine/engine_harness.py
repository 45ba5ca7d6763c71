"""A real ``mmis engine`` subprocess and a client that talks to it over its real ZMQ sockets.

Invariants:
- The engine runs as ``python -m mmis engine`` on fresh IPC addresses under a private temp
  directory (or free loopback TCP ports); nothing is mocked between the test and the engine.
- The client speaks the production wire: ``WireCodec`` frames, PUSH to the engine's PULL,
  SUB on the engine's PUB with the topic ``b"c<client_index>"``, and the ``hello`` handshake
  repeated until answered (which proves the subscription is live).
- :class:`EngineHarness` always terminates its process (SIGTERM, then SIGKILL), on normal
  exit, on a failed start and on exceptions; its combined stdout/stderr stays readable in
  :attr:`EngineHarness.log_path` for assertions and failure messages.
- Waiting is event-driven (socket polls with a deadline); a deadline that passes raises with
  the tail of the engine log instead of hanging.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import zmq

from mmis.protocol.codec import WireCodec
from mmis.protocol.messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestError,
    UtilityCall,
)

START_TIMEOUT_S = 240.0
DEFAULT_TIMEOUT_S = 180.0


class EngineDied(RuntimeError):
    """The engine process exited or stopped answering."""


@dataclasses.dataclass
class Result:
    """Everything the engine sent back for one request id (all choices)."""

    request_id: str
    tokens: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    finish_reason: dict[int, str] = dataclasses.field(default_factory=dict)
    stop_reason: dict[int, Any] = dataclasses.field(default_factory=dict)
    error: RequestError | None = None
    missing_mm_hashes: list[str] = dataclasses.field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_outputs: int = 0
    pooled: dict[int, Any] = dataclasses.field(default_factory=dict)

    @property
    def done(self) -> bool:
        if self.error is not None:  # one terminal error ends the whole request
            return True
        return bool(self.finish_reason)  # the engine runs one choice per request

    @property
    def token_ids(self) -> list[int]:
        return self.tokens.get(0, [])


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EngineHarness:
    """Start, drive and always stop one ``mmis engine`` process."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *args: str,
        transport: str = "ipc",
        client_index: int = 0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.model_dir = str(model_dir)
        self.args = list(args)
        self.client_index = client_index
        self.workdir = Path(tempfile.mkdtemp(prefix="mmis-eng-"))
        if transport == "ipc":
            self.input_address = f"ipc://{self.workdir}/in"
            self.output_address = f"ipc://{self.workdir}/out"
        else:
            self.input_address = f"tcp://127.0.0.1:{free_tcp_port()}"
            self.output_address = f"tcp://127.0.0.1:{free_tcp_port()}"
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.log_path = self.workdir / "engine.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.codec = WireCodec()
        self.ctx = zmq.Context()
        self.push: Any = None
        self.sub: Any = None
        self.results: dict[str, Result] = {}
        self.batches: list[EngineCoreOutputs] = []
        self._utility: dict[int, Any] = {}
        self._call_id = 0
        self.hello: dict[str, Any] = {}

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> EngineHarness:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        cmd = [sys.executable, "-m", "mmis", "engine", "--model", self.model_dir]
        cmd += ["--input-address", self.input_address, "--output-address", self.output_address]
        cmd += ["--device", "cpu", *self.args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        try:
            self._connect()
            self.hello = self._handshake(START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise

    def _connect(self) -> None:
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(self.input_address)
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"c%d" % self.client_index)
        self.sub.connect(self.output_address)

    def _handshake(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            call_id = self._send_call("hello", [])
            try:
                return dict(self._wait_utility(call_id, min(0.5, deadline - time.monotonic())))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
                self._utility.pop(call_id, None)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM the engine (SIGKILL after ``timeout``); returns its exit code."""
        for sock in (self.push, self.sub):
            if sock is not None:
                sock.close(linger=0)
        self.push = self.sub = None
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                return proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
        return proc.wait()

    def kill(self) -> None:
        """SIGKILL, like a crashed or OOM-killed P1."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.stop()

    def restart(self, *args: str) -> None:
        """Stop and start again; ``args`` (if given) replace the engine's extra arguments."""
        self.stop()
        if args:
            self.args = list(args)
        self.start()

    def close(self) -> None:
        self.stop()
        self.ctx.term()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    # ---------------------------------------------------------------- sending
    def send(self, *requests: EngineCoreRequest) -> None:
        for request in requests:
            request.client_index = self.client_index
            self.results[request.request_id] = Result(request.request_id)
            self.push.send_multipart(self.codec.encode_request(request), copy=False)

    def abort(self, request_ids: Sequence[str]) -> None:
        msg = AbortRequests(list(request_ids), client_index=self.client_index)
        self.push.send_multipart(self.codec.encode_request(msg), copy=False)

    def _send_call(self, method: str, args: list[Any]) -> int:
        self._call_id += 1
        call = UtilityCall(self._call_id, method, args, client_index=self.client_index)
        self.push.send_multipart(self.codec.encode_request(call), copy=False)
        return self._call_id

    def call(self, method: str, *args: Any, timeout: float = DEFAULT_TIMEOUT_S) -> Any:
        """A utility call; raises ``RuntimeError`` with the engine's message if it failed."""
        return self._wait_utility(self._send_call(method, list(args)), timeout)

    # ---------------------------------------------------------------- receiving
    def pump(self, timeout: float) -> bool:
        """Receive and file at most one batch; False if none came within ``timeout``."""
        if self.sub.poll(max(int(timeout * 1000), 0)) == 0:
            if not self.alive:
                raise EngineDied(f"engine exited ({self._exit()}):\n{self._tail()}")
            return False
        frames = self.sub.recv_multipart(copy=False)
        batch = self.codec.decode_outputs([f.buffer for f in frames[1:]])
        self.batches.append(batch)
        if batch.utility_result is not None:
            self._utility[batch.utility_result.call_id] = batch.utility_result
        for out in batch.outputs:
            res = self.results.setdefault(out.request_id, Result(out.request_id))
            res.num_outputs += 1
            res.tokens.setdefault(out.index, []).extend(out.new_token_ids)
            res.num_prompt_tokens = max(res.num_prompt_tokens, out.num_prompt_tokens)
            res.num_cached_tokens = max(res.num_cached_tokens, out.num_cached_tokens)
            if out.error is not None:
                res.error = out.error
                res.missing_mm_hashes = list(out.missing_mm_hashes)
            if out.pooled is not None:
                res.pooled[out.index] = out.pooled
            if out.finish_reason is not None:
                res.finish_reason[out.index] = out.finish_reason
                res.stop_reason[out.index] = out.stop_reason
        return True

    def _wait_utility(self, call_id: int, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while call_id not in self._utility:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer to utility call {call_id}:\n{self._tail()}")
            self.pump(left)
        result = self._utility.pop(call_id)
        if not result.ok:
            raise RuntimeError(f"utility call failed: {result.error}")
        return result.result

    def wait_until(self, predicate: Any, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"condition not reached in {timeout}s:\n{self._tail()}")
            self.pump(left)

    def collect(
        self, request_ids: Iterable[str], timeout: float = DEFAULT_TIMEOUT_S
    ) -> dict[str, Result]:
        ids = list(request_ids)
        self.wait_until(
            lambda: all(i in self.results and self.results[i].done for i in ids), timeout
        )
        return {i: self.results[i] for i in ids}

    def run(self, *requests: EngineCoreRequest, timeout: float = DEFAULT_TIMEOUT_S) -> list[Result]:
        self.send(*requests)
        found = self.collect([r.request_id for r in requests], timeout)
        return [found[r.request_id] for r in requests]

    def _exit(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def _tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])
