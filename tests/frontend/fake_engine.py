"""A scripted P1 for front-end tests: the REAL P1 shell, sockets, codec and receiver cache,
with a deterministic fake core instead of the model, and knobs that force misses.

- :class:`ScriptedCore` answers generation requests with ``max_tokens`` tokens (one per step)
  computed from the prompt and the item tensors, so the output depends on the image data
  that actually reached P1; pooling requests get a vector derived the same way.
- :class:`FakeEngine` runs :class:`EngineCoreProc` (the real P1 process shell: input thread
  with the receiver cache, busy loop, output thread) in background threads on ``ipc://``
  addresses. ``force_misses(k)`` makes the next ``k`` requests fail with a
  ``multimodal_cache_miss`` naming all their items *even if they carried data* (the only way
  to force a second miss, S4); ``evict_all()`` drops every cached item silently (drift);
  ``hold()``/``release()`` stop and restart token generation (events, not sleeps).
"""

from __future__ import annotations

import base64
import io
import socket
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import uvicorn
from PIL import Image

from mmis.engine.core_process import EngineCoreProc
from mmis.frontend.api.api_server import create_app
from mmis.frontend.config import FrontendConfig
from mmis.frontend.state import FrontendState
from mmis.multimodal.cache import ReceiverCache
from mmis.protocol.errors import MultiModalCacheMissError
from mmis.protocol.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    ErrorCode,
    FinishReason,
    RequestError,
)
from mmis.shm import ShmReaderSet
from mmis.telemetry.tracing import Tracing

VOCAB_LOW, VOCAB_HIGH = 262, 448  # tokens of the tiny LLaVA tokenizer that decode to ASCII


def checksum(mm_inputs: Sequence[dict[str, np.ndarray] | None]) -> int:
    total = 0
    for tensors in mm_inputs:
        for name in sorted(tensors or {}):
            total = zlib.crc32(np.ascontiguousarray(tensors[name]).tobytes(), total)
    return total


class ScriptedCore:
    def __init__(self, max_model_len: int = 4096) -> None:
        self.max_model_len = max_model_len
        self.running: dict[str, dict[str, Any]] = {}
        self.order: list[str] = []
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.pause_after_first_token = False  # clear ``gate`` once a token went out
        self.request_added = threading.Event()
        self.request_aborted = threading.Event()
        self._finished: list[EngineCoreOutput] = []

    def add_request(self, request: EngineCoreRequest) -> None:
        self.added.append(request.request_id)
        self.request_added.set()
        tensors = [f.data if isinstance(f.data, dict) else None for f in request.mm_features]
        base = (sum(request.prompt_token_ids) * 31 + checksum(tensors)) % 1_000_003
        if request.pooling_params is not None:
            rng = np.random.default_rng(base)
            vec = rng.standard_normal(8).astype(np.float32)
            vec /= np.linalg.norm(vec)
            self._finished.append(
                EngineCoreOutput(
                    request.request_id,
                    finish_reason=FinishReason.STOP.value,
                    num_prompt_tokens=len(request.prompt_token_ids),
                    pooled=vec,
                )
            )
            return
        params = request.sampling_params
        max_tokens = params.max_tokens if params is not None else 16
        if len(request.prompt_token_ids) + max_tokens > self.max_model_len:
            self._finished.append(
                EngineCoreOutput(
                    request.request_id,
                    finish_reason=FinishReason.ERROR.value,
                    error=RequestError(ErrorCode.CONTEXT_LENGTH_EXCEEDED.value, "too long"),
                )
            )
            return
        self.running[request.request_id] = {
            "base": base + 13 * ((params.seed or 0) if params else 0),
            "left": max_tokens,
            "k": 0,
            "prompt": len(request.prompt_token_ids),
        }
        self.order.append(request.request_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.aborted.append(rid)
            self.request_aborted.set()
            if self.running.pop(rid, None) is not None:
                self.order.remove(rid)

    def is_live(self, request_id: str) -> bool:
        return request_id in self.running

    def has_work(self) -> bool:
        return bool(self._finished) or (bool(self.running) and self.gate.is_set())

    def step(self) -> list[EngineCoreOutput]:
        outs, self._finished = self._finished, []
        if not self.gate.is_set():
            return outs
        for rid in list(self.order):
            state = self.running[rid]
            token = VOCAB_LOW + (state["base"] + 7 * state["k"]) % (VOCAB_HIGH - VOCAB_LOW)
            state["k"] += 1
            state["left"] -= 1
            done = state["left"] <= 0
            outs.append(
                EngineCoreOutput(
                    rid,
                    new_token_ids=[token],
                    finish_reason=FinishReason.LENGTH.value if done else None,
                    num_prompt_tokens=state["prompt"],
                )
            )
            if done:
                del self.running[rid]
                self.order.remove(rid)
        if self.pause_after_first_token and outs:
            self.gate.clear()
        return outs

    def utilities(self) -> dict[str, Callable[..., Any]]:
        return {"running": lambda: sorted(self.running)}


class _ScriptedProc(EngineCoreProc):
    """The real shell; ``_admit`` may be told to fail requests with images on purpose."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.forced_misses = 0
        self.evict_before_next = False
        self.knob_lock = threading.Lock()
        self.misses_sent: list[list[str]] = []  # forced misses
        self.missed: list[str] = []  # request ids answered with any miss

    def _admit(self, request: EngineCoreRequest) -> None:
        with self.knob_lock:
            if self.evict_before_next:
                self.evict_before_next = False
                self.receiver.evict(self.receiver.keys(), silent=True)
            force = self.forced_misses > 0
            if force:
                self.forced_misses -= 1
        if force:
            hashes = [f.mm_hash for f in request.mm_features]
            for f in request.mm_features:  # still read (and ack) SHM descriptors
                if f.data is not None:
                    self.receiver._read(f)
            miss = MultiModalCacheMissError(hashes)
            self.misses_sent.append(hashes)
            out = EngineCoreOutput(
                request_id=request.request_id,
                finish_reason=FinishReason.ERROR.value,
                error=miss.to_wire(),
                missing_mm_hashes=miss.mm_hashes,
            )
            self._send(request.client_index, [out])
            return
        super()._admit(request)

    def _send(self, client: int, outputs: list[EngineCoreOutput]) -> None:
        self.missed.extend(o.request_id for o in outputs if o.missing_mm_hashes)
        super()._send(client, outputs)


class FakeEngine:
    def __init__(
        self,
        directory: str,
        *,
        cache_bytes: int = 1 << 30,
        epoch: str = "epoch-1",
        shm_dir: str | None = None,
        max_model_len: int = 4096,
    ) -> None:
        self.input_address = f"ipc://{directory}/p1-in"
        self.output_address = f"ipc://{directory}/p1-out"
        self.shm_readers = ShmReaderSet(shm_dir) if shm_dir else None
        reader = self.shm_readers.receive if self.shm_readers is not None else None
        self.core = ScriptedCore(max_model_len)
        self.receiver = ReceiverCache(cache_bytes, shm_reader=reader)
        self.proc = _ScriptedProc(
            self.core,
            self.receiver,
            self.input_address,
            self.output_address,
            cache_epoch=epoch,
        )
        self._thread = threading.Thread(target=self.proc.run, name="fake-p1", daemon=True)

    def start(self) -> FakeEngine:
        self._thread.start()
        if not self.proc.ready.wait(10):
            raise RuntimeError("the fake engine did not bind its sockets")
        return self

    def stop(self) -> None:
        self.proc.shutdown()
        self._thread.join(timeout=10)
        if self.shm_readers is not None:
            self.shm_readers.close()

    def force_misses(self, count: int) -> None:
        with self.proc.knob_lock:
            self.proc.forced_misses = count

    def evict_all_before_next(self) -> None:
        """Drop every cached item (silently) right before the next request is resolved."""
        with self.proc.knob_lock:
            self.proc.evict_before_next = True

    @contextmanager
    def held(self) -> Iterator[None]:
        """No tokens are generated inside the block (misses and errors still flow)."""
        self.core.gate.clear()
        try:
            yield
        finally:
            self.core.gate.set()


class RunningFrontend:
    """P0 (the real app, real uvicorn, real HTTP) in a background thread of this process.

    The state is reachable (``.state``) for leak checks; ``base_url`` is the OpenAI base URL.
    """

    def __init__(
        self,
        settings: FrontendConfig,
        tracing: Tracing | None = None,
    ) -> None:
        self._state_ready = threading.Event()
        self.state: FrontendState | None = None
        app = create_app(settings, on_state=self._on_state, tracing=tracing)
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.port = int(self._sock.getsockname()[1])
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.root_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, name="p0", daemon=True
        )

    def _on_state(self, state: FrontendState) -> None:
        self.state = state
        self._state_ready.set()

    def start(self, timeout: float = 120.0) -> RunningFrontend:
        self._thread.start()
        if not self._state_ready.wait(timeout):
            raise RuntimeError("P0 did not start (engine handshake?)")
        assert self.state is not None
        if not self.state.ready_event.wait(timeout):
            raise RuntimeError("P0 never became ready (synthetic request failed)")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()


def image_data_url(color: tuple[int, int, int], size: tuple[int, int] = (48, 40)) -> str:
    """A PNG data URL of a two-tone image (distinct colours give distinct hashes)."""
    image = Image.new("RGB", size, color)
    image.paste((255 - color[0], 255 - color[1], 255 - color[2]), (0, 0, size[0] // 2, size[1]))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_part(color: tuple[int, int, int], uuid: str | None = None) -> dict[str, Any]:
    inner: dict[str, Any] = {"url": image_data_url(color)}
    if uuid is not None:
        inner["uuid"] = uuid
    return {"type": "image_url", "image_url": inner}
