"""Real ``mmis encoder`` processes and a P0-like client for the encoder tests (the session's
processes are ``conftest.py``'s fixtures).

Each encoder runs on CPU in float32 on a tiny model, on a loopback port it picks (``--endpoint
tcp://127.0.0.1:0``), with a token from ``MMIS_ENCODER_TOKEN`` (so the tests exercise the
ZMQ PLAIN path; every client below presents it), ``--health-port 0`` for ``/metrics``, and a
small ``--max-message-mb``. Waiting for one is a bounded wait for its ready line.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools import Daemon, wait_until

from mmis.engine.event_auth import secure_client
from mmis.protocol.codec import WireCodec
from mmis.protocol.encoder import EncodeReply, EncodeRequest

MMIS = str(Path(sys.executable).parent / "mmis")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
TOKEN = "encoder-test-token"
MAX_MESSAGE_MB = 2
READY = re.compile(r"mmis encoder: ready on (tcp://\S+) health (http://\S+)")
EVENTS = re.compile(r"output cache events on (tcp://\S+) \(replay: (tcp://\S+)\)")


class EncoderProc(Daemon):
    """``mmis encoder --model MODEL ...``; ``endpoint`` and ``root_url`` from its ready line."""

    prefix = (MMIS,)
    base_env = OFFLINE

    def __init__(self, name: str, model: Path, log_dir: Path, *extra: str) -> None:
        super().__init__(
            name,
            [
                "encoder",
                "--model",
                str(model),
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--threads",
                "1",
                "--endpoint",
                "tcp://127.0.0.1:0",
                "--health-port",
                "0",
                "--cache-gb",
                "0.01",
                "--max-batch-items",
                "4",
                "--max-message-mb",
                str(MAX_MESSAGE_MB),
                *extra,
            ],
            log_dir,
            env={"MMIS_ENCODER_TOKEN": TOKEN},
        )
        found = wait_until(f"{name} ready", self._ready, 120, self)
        assert isinstance(found, re.Match)
        self.endpoint, self.root_url = found.group(1), found.group(2)
        events = EVENTS.search(self.log_path.read_text(errors="replace"))
        self.events_replay = events.group(2) if events else None

    def _ready(self) -> re.Match[str] | None:
        if self.popen.poll() is not None:
            raise RuntimeError(f"{self.name} exited {self.popen.returncode}\n{self.log_tail()}")
        return READY.search(self.log_path.read_text(errors="replace"))


class Client:
    """A P0-like DEALER; ``token=None`` presents no credentials."""

    def __init__(self, endpoint: str, token: str | None = TOKEN) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if token is not None:
            secure_client(self.sock, token)
        self.sock.connect(endpoint)
        self.codec = WireCodec()
        self._ids = 1000

    def send_frames(self, frames: list[Any]) -> None:
        self.sock.send_multipart(frames)

    def ask(self, request: EncodeRequest, timeout_s: float = 30.0) -> EncodeReply | None:
        """The reply to ``request`` (replies to other ids are skipped), None on timeout."""
        self.sock.send_multipart(self.codec.encode(request))
        while self.sock.poll(int(timeout_s * 1000)):
            reply = self.codec.decode(self.sock.recv_multipart(), EncodeReply)
            if reply.request_id == request.request_id:
                return reply
        return None

    def next_id(self) -> int:
        self._ids += 1
        return self._ids

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()
