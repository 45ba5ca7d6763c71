"""The P1 process shell: sockets, threads and the busy loop around an :class:`EngineCore`.

Threads and what each one owns (the invariants that keep P1 crash-free under drift):
- the **input thread** owns the PULL socket and the :class:`ReceiverCache`: it decodes every
  message, resolves multimodal features (the only place the receiver cache is touched) and
  answers a cache miss *itself* with a ``finish_reason="error"`` output listing every missing
  hash — a request with a miss never reaches the scheduler;
- the **busy loop** (the thread that calls :meth:`EngineCoreProc.run`) owns the core: it
  admits resolved requests, aborts, runs steps and core utility calls;
- the **output thread** (:class:`OutputChannel`) owns the PUB socket: it encodes and sends
  outputs, one topic frame per client (``client_index``), each batch stamped with the cache
  epoch and the evictions that client has not yet been told about.
- No message can stop a thread: a malformed one is dropped (logged), an unexpected failure
  while admitting a request is answered with an ``internal_error`` output.
- Every output of a request reaches the client that sent it, for all ``n`` choices; the
  owner is forgotten once every choice finished, one error ended them, or on abort.
- ``reset_mm_cache`` empties the receiver cache and switches to its new epoch, so P0 drops
  its whole shadow instead of drifting.

Wire: P0 processes PUSH to our PULL (many clients may share one P1); we PUB to their SUB with
the client index as the topic. A client handshakes with the ``hello`` utility call until the
answer arrives, which proves its subscription is live.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import zmq

from mmis.engine.output_channel import OutputChannel, topic
from mmis.multimodal.cache import ReceiverCache
from mmis.protocol.codec import WireCodec as Codec
from mmis.protocol.errors import MMISError, MultiModalCacheMissError, ProtocolError
from mmis.protocol.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreRequest,
    ErrorCode,
    FinishReason,
    RequestError,
    RequestType,
    UtilityCall,
    UtilityResult,
)

log = logging.getLogger(__name__)

MMInputs = list[dict[str, np.ndarray] | None]


class EngineCore(Protocol):
    """What the busy loop drives; :mod:`mmis.engine.core` implements it."""

    def add_request(self, request: EngineCoreRequest, mm_inputs: MMInputs) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[EngineCoreOutput]: ...

    def call_utility(self, method: str, args: list[Any]) -> Any: ...


__all__ = ["EngineCore", "EngineCoreProc", "MMInputs", "topic"]


class EngineCoreProc:
    def __init__(
        self,
        core: EngineCore,
        receiver: ReceiverCache,
        input_address: str,
        output_address: str,
        *,
        cache_epoch: str,
        fault_evict_rate: float = 0.0,
        engine_index: int = 0,
        seed: int | None = None,
    ) -> None:
        self.core = core
        self.receiver = receiver
        self.input_address = input_address
        self.output_address = output_address
        self.engine_index = engine_index
        self.fault_evict_rate = fault_evict_rate
        self._rng = random.Random(seed)
        self._ctx = zmq.Context()
        self._core_queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._out = OutputChannel(cache_epoch=cache_epoch, engine_index=engine_index)
        # request id -> [client index, choices not finished yet] (busy loop only)
        self._owner: dict[str, list[int]] = {}
        self._stop = threading.Event()
        self._in_codec = Codec()  # input thread only
        self._threads: list[threading.Thread] = []
        self.ready = threading.Event()
        if fault_evict_rate > 0:
            log.warning(
                "FAULT INJECTION ON: the engine evicts %.0f%% of cached multimodal items "
                "on purpose before resolving requests (--fault-evict-rate). Never use this "
                "in production.",
                fault_evict_rate * 100,
            )

    @property
    def cache_epoch(self) -> str:
        return self._out.cache_epoch

    @cache_epoch.setter
    def cache_epoch(self, epoch: str) -> None:
        self._out.cache_epoch = epoch

    # ---------------------------------------------------------------- input thread
    def _input_loop(self) -> None:
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.input_address)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        self.ready.set()
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                frames = sock.recv_multipart(copy=False)
                try:
                    self._handle_frames([f.buffer for f in frames])
                except ProtocolError as exc:
                    log.warning("dropped a malformed message: %s", exc)
                except Exception:  # the input thread must outlive any one message
                    log.exception("failed to handle a message; dropped it")
        finally:
            sock.close()

    def _handle_frames(self, frames: list[memoryview]) -> None:
        kind, msg = self._in_codec.decode_request(frames)
        if kind == RequestType.ADD and isinstance(msg, EngineCoreRequest):
            self._admit(msg)
        elif kind == RequestType.ABORT and isinstance(msg, AbortRequests):
            self._core_queue.put(("abort", msg.request_ids))
        elif kind == RequestType.UTILITY and isinstance(msg, UtilityCall):
            self._utility(msg)

    def _admit(self, request: EngineCoreRequest) -> None:
        if self.fault_evict_rate > 0:
            cached = [f.mm_hash for f in request.mm_features if f.mm_hash in self.receiver]
            victims = [h for h in cached if self._rng.random() < self.fault_evict_rate]
            self.receiver.evict(victims, silent=True)
        try:
            mm_inputs: MMInputs = list(self.receiver.resolve(request.mm_features))
        except MultiModalCacheMissError as miss:
            self._publish_evictions()
            out = EngineCoreOutput(
                request_id=request.request_id,
                finish_reason=FinishReason.ERROR.value,
                error=miss.to_wire(),
                missing_mm_hashes=miss.mm_hashes,
            )
            self._send(request.client_index, [out])
            return
        except MMISError as exc:
            self._send_error(request, exc.to_wire())
            return
        except Exception as exc:  # e.g. an I/O error reading shared memory
            log.exception("resolving the items of %s failed", request.request_id)
            self._send_error(request, RequestError(ErrorCode.INTERNAL.value, str(exc)))
            return
        self._publish_evictions()
        self._core_queue.put(("add", (request, mm_inputs)))

    def _send_error(self, request: EngineCoreRequest, error: RequestError) -> None:
        out = EngineCoreOutput(
            request_id=request.request_id, finish_reason=FinishReason.ERROR.value, error=error
        )
        self._send(request.client_index, [out])

    def _publish_evictions(self) -> None:
        self._out.publish_evictions(self.receiver.drain_evicted())

    # Utility calls that touch the receiver cache run here, on its owning thread.
    def _utility(self, call: UtilityCall) -> None:
        local: dict[str, Callable[[], Any]] = {
            "hello": lambda: {"cache_epoch": self.cache_epoch, "engine_index": self.engine_index},
            "receiver_stats": self.receiver.stats,
            "reset_mm_cache": self._reset_mm_cache,
            "set_fault_evict_rate": lambda: self._set_fault(*call.args),
        }
        self._out.register(call.client_index)
        if call.method in local:
            self._answer(call, local[call.method])
        else:
            self._core_queue.put(("utility", call))

    def _reset_mm_cache(self) -> bool:
        self.receiver.clear()
        self.cache_epoch = self.receiver.epoch  # P0 drops its whole shadow on the new epoch
        return True

    def _set_fault(self, rate: float) -> float:
        if not 0.0 <= float(rate) <= 1.0:
            raise ValueError("fault evict rate must be within [0, 1]")
        self.fault_evict_rate = float(rate)
        log.warning("fault evict rate set to %.3f", self.fault_evict_rate)
        return self.fault_evict_rate

    def _answer(self, call: UtilityCall, fn: Callable[[], Any]) -> None:
        try:
            result = UtilityResult(call_id=call.call_id, ok=True, result=fn())
        except Exception as exc:  # a failed utility call is answered, never fatal
            err = RequestError(code="utility_failed", message=f"{call.method}: {exc}")
            result = UtilityResult(call_id=call.call_id, ok=False, error=err)
        self._out.answer(call.client_index, result)

    # ---------------------------------------------------------------- busy loop
    def run(self) -> None:
        """Start the I/O threads and run the busy loop until :meth:`shutdown`."""
        threads = {
            "input": threading.Thread(target=self._input_loop),
            "output": threading.Thread(target=self._out.run, args=(self._ctx, self.output_address)),
        }
        for name, thread in threads.items():
            thread.name, thread.daemon = f"mmis-engine-{name}", True
            thread.start()
            self._threads.append(thread)
        try:
            while not self._stop.is_set():
                self._drain_core_queue(block=not self.core.has_work())
                if self.core.has_work():
                    self._route(self.core.step())
        finally:
            self._out.close()
            for thread in self._threads:
                thread.join(timeout=5)
            self._ctx.term()

    def shutdown(self) -> None:
        self._stop.set()

    def _drain_core_queue(self, block: bool) -> None:
        try:
            item = self._core_queue.get(timeout=0.1) if block else self._core_queue.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(*item)
            try:
                item = self._core_queue.get_nowait()
            except queue.Empty:
                return

    def _apply(self, kind: str, payload: Any) -> None:
        if kind == "add":
            request, mm_inputs = payload
            n = request.sampling_params.n if request.sampling_params is not None else 1
            self._owner[request.request_id] = [request.client_index, max(n, 1)]
            try:
                self.core.add_request(request, mm_inputs)
            except Exception as exc:  # admission answers bad input; this is an engine bug
                log.exception("admitting %s failed", request.request_id)
                self._owner.pop(request.request_id, None)
                self._send_error(request, RequestError(ErrorCode.INTERNAL.value, str(exc)))
        elif kind == "abort":
            self.core.abort_requests(list(payload))
            for rid in payload:  # aborted requests get no output: forget their owner now
                self._owner.pop(rid, None)
        elif kind == "utility":
            call: UtilityCall = payload
            self._answer(call, lambda: self.core.call_utility(call.method, call.args))

    def _route(self, outputs: list[EngineCoreOutput]) -> None:
        by_client: defaultdict[int, list[EngineCoreOutput]] = defaultdict(list)
        for out in outputs:
            by_client[self._owner.get(out.request_id, [0])[0]].append(out)
        for out in outputs:  # after routing all: the choices of one step share an owner
            owner = self._owner.get(out.request_id)
            if owner is None or out.finish_reason is None:
                continue
            owner[1] -= 1
            if owner[1] <= 0 or out.error is not None:  # an error ends every choice
                del self._owner[out.request_id]
        for client, outs in by_client.items():
            self._send(client, outs)

    # ---------------------------------------------------------------- to the clients
    def _send(self, client: int, outputs: list[EngineCoreOutput]) -> None:
        """The one funnel for request outputs (front-end test doubles hook it)."""
        self._out.send(client, outputs)
