"""The P1 process shell: sockets, threads and the busy loop around an :class:`EngineCore`.

Threads and what each one owns (the invariants that keep P1 crash-free under drift):
- the **input thread** owns the PULL socket and the :class:`ReceiverCache`: it decodes every
  message, resolves multimodal features (the only place the receiver cache is touched) and
  answers a cache miss *itself* with a ``finish_reason="error"`` output listing every missing
  hash — a request with a miss never reaches the scheduler; an item whose encoder output
  (``MM_EMBEDS``, E/PD) fails its check (``engine/encoder_inputs.py``) is evicted, announced
  and answered the same way, so P0's drift retry resends its pixels (never a failed request);
- the **busy loop** (the thread that calls :meth:`EngineCoreProc.run`) owns the core: it
  admits resolved requests, aborts, runs steps and core utility calls. The input thread hands
  it typed messages (:class:`AddRequest`, :class:`Abort`, :class:`CoreUtility`) on one queue;
- the **output thread** (:class:`OutputChannel`) owns the PUB socket: it encodes and sends
  outputs, one topic frame per client (``client_index``), each batch stamped with the cache
  epoch and what that client has not yet heard of the receiver cache: the evictions, and
  the items other clients' requests stored (the input thread publishes both after every
  message it handled; the N-shadow invariant is in ``multimodal/cache.py``).
- No message can stop a thread: a malformed one is dropped (logged), an unexpected failure
  while admitting a request is answered with an ``internal_error`` output.
- Every output of a request reaches the client that sent it; the owner is forgotten once the
  request finished or was aborted.
- Utility calls are dispatched in one place, :meth:`EngineCoreProc._utility`, by one table
  (:meth:`EngineCoreProc.utilities`): the shell's own calls run on the input thread (they
  touch the receiver cache), the core's (:meth:`EngineCore.utilities`) on the busy loop.
  A call that raises is answered, never fatal, with its exception's ``code`` when typed (the
  LoRA refusals, ``unknown_utility``), else ``utility_failed`` (:func:`utility_error`).
- ``reset_mm_cache`` empties the receiver cache and switches to its new epoch, so P0 drops
  its whole shadow instead of drifting. ``mm_cache_sync`` (a P0's once, after its
  handshake) queues for that client a reset and what the receiver holds now, so a restarted
  P0 learns every item already in P1.

Wire: P0 processes PUSH to our PULL (many clients may share one P1); we PUB to their SUB with
the client index as the topic. A client handshakes with the ``hello`` utility call until the
answer arrives, which proves its subscription is live.

Liveness: ``hello`` is also P0's heartbeat (every ``--ping-interval-s``). It is answered on the
input thread, never queued behind the busy loop, so a long prefill or step does not look like a
hang; the answer only needs this process scheduled and its input and output threads running.
P0 sees a crash through its sockets, not through missing answers
(``frontend/client/engine_liveness.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import queue
import random
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import msgspec
import zmq

from mmis.engine.encoder_inputs import REASONS, EmbedsSpec, Rejection, check_embeds
from mmis.engine.mm_events import MMEventStream
from mmis.engine.output_channel import MAX_BACKLOG, OutputChannel, topic
from mmis.multimodal.cache import ReceiverCache, Tensors
from mmis.protocol.codec import WireCodec as Codec
from mmis.protocol.encoder import MM_EMBEDS
from mmis.protocol.errors import MMISError, MultiModalCacheMissError, ProtocolError
from mmis.protocol.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreRequest,
    ErrorCode,
    FinishReason,
    MultiModalFeature,
    RequestError,
    RequestType,
    UtilityCall,
    UtilityResult,
)

log = logging.getLogger(__name__)

# The cyclic collector's youngest-generation threshold while the busy loop runs. It collects
# once tracked allocations minus deallocations exceed the threshold; a decode step keeps ~7
# container objects per running request alive at its peak (scheduled rows, events, outputs),
# all freed by reference counting when the step ends. At CPython's 700 a step of 100+ rows
# collected 2-3 times and promoted those temporaries, which then triggered full collections
# (every live request's token lists traversed: ~10 ms a pass at 256 x 1k tokens;
# benchmarks/README.md). Above a step's peak (up to ~1k rows), collections run only as
# long-lived objects accumulate (admissions); the older thresholds stay CPython's.
GC_GEN0_THRESHOLD = 10_000


def tune_gc() -> None:
    """Raise the youngest generation's threshold to :data:`GC_GEN0_THRESHOLD` (process-wide)."""
    gen0, gen1, gen2 = gc.get_threshold()
    if 0 < gen0 < GC_GEN0_THRESHOLD:  # 0: automatic collection is off; leave it so
        gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


class EngineCore(Protocol):
    """What the busy loop drives; :mod:`mmis.engine.core` implements it."""

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[EngineCoreOutput]: ...

    def utilities(self) -> Mapping[str, Callable[..., Any]]: ...


__all__ = [
    "MM_CACHE_SYNC",
    "EngineCore",
    "EngineCoreProc",
    "UnknownUtilityError",
    "topic",
    "utility_error",
]

MM_CACHE_SYNC = "mm_cache_sync"
"""The utility call a P0 makes once after its handshake: the receiver's current entries."""


@dataclasses.dataclass(frozen=True, slots=True)
class AddRequest:
    """A resolved request for the core (input thread -> busy loop): every item's ``data``
    holds its tensors."""

    request: EngineCoreRequest


@dataclasses.dataclass(frozen=True, slots=True)
class Abort:
    request_ids: list[str]


@dataclasses.dataclass(frozen=True, slots=True)
class CoreUtility:
    """A utility call the busy loop runs on the core."""

    call: UtilityCall
    fn: Callable[..., Any]


CoreMessage = AddRequest | Abort | CoreUtility


class UnknownUtilityError(MMISError, ValueError):
    """A utility call naming a method this engine lacks (``unknown_utility``: P0 reads the
    LoRA calls' as an engine without ``--enable-lora``)."""

    code = ErrorCode.UNKNOWN_UTILITY.value


def _unknown(method: str) -> Callable[..., Any]:
    def fail(*_args: Any) -> Any:
        raise UnknownUtilityError(f"unknown utility method {method!r}")

    return fail


def utility_error(method: str, exc: Exception) -> RequestError:
    """The wire error of a utility call that raised ``exc``: its own ``code`` when it is typed
    (:class:`MMISError`: the LoRA refusals, an unknown method), else ``utility_failed``; the
    message is ``"<method>: <exc>"``."""
    code = exc.code if isinstance(exc, MMISError) else ErrorCode.UTILITY_FAILED.value
    return RequestError(code=code, message=f"{method}: {exc}")


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
        model_info: Mapping[str, str] | None = None,
        mm_events: MMEventStream | None = None,
        embeds_spec: EmbedsSpec | None = None,
    ) -> None:
        self.core = core
        # what an encoder output must be (engine/encoder_inputs.py); None: this engine takes
        # none, and every item that carries one is answered as a miss (P0 resends pixels)
        self.embeds_spec = embeds_spec
        self.rejected: dict[str, int] = dict.fromkeys(REASONS, 0)  # input thread only
        # the receiver cache's changes for routers (engine/mm_events.py); None: not announced
        self.mm_events = mm_events
        if mm_events is not None:
            receiver.listener = mm_events.log
        self.model_info = dict(model_info or {})  # what ``hello`` says of the model (dtype)
        self.receiver = receiver
        self.input_address = input_address
        self.output_address = output_address
        self.engine_index = engine_index
        self.fault_evict_rate = fault_evict_rate
        self._rng = random.Random(seed)
        self._ctx = zmq.Context()
        self._core_queue: queue.Queue[CoreMessage] = queue.Queue()
        self._out = OutputChannel(cache_epoch=cache_epoch, engine_index=engine_index)
        self._owner: dict[str, int] = {}  # request id -> client index (busy loop only)
        # the shell's utility calls (they touch the receiver cache); the core adds its own
        self._shell_utilities: dict[str, Callable[..., Any]] = {
            "hello": self._hello,
            "receiver_stats": self._receiver_stats,
            "reset_mm_cache": self._reset_mm_cache,
            "set_fault_evict_rate": self._set_fault,
            MM_CACHE_SYNC: self._sync_shadow,  # called with the caller's client index
        }
        self._stop = threading.Event()
        self._in_codec = Codec()  # input thread only
        self._threads: list[threading.Thread] = []
        self._loop_thread: threading.Thread | None = None
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
        origin: int | None = None
        try:
            if kind == RequestType.ADD and isinstance(msg, EngineCoreRequest):
                origin = msg.client_index
                self._admit(msg)
            elif kind == RequestType.ABORT and isinstance(msg, AbortRequests):
                self._core_queue.put(Abort(list(msg.request_ids)))
            elif kind == RequestType.UTILITY and isinstance(msg, UtilityCall):
                self._utility(msg)
        finally:  # what is left to tell (a failed resolve may have stored items)
            self._publish_changes(origin)
        if self.mm_events is not None:  # what this message changed in the receiver cache
            self.mm_events.flush()

    def _admit(self, request: EngineCoreRequest) -> None:
        if self.fault_evict_rate > 0:
            cached = [f.mm_hash for f in request.mm_features if f.mm_hash in self.receiver]
            victims = [h for h in cached if self._rng.random() < self.fault_evict_rate]
            self.receiver.evict(victims, silent=True)
        try:
            tensors = self.receiver.resolve(request.mm_features)
        except MultiModalCacheMissError as miss:
            # items stored before the miss are checked now, so no later hit is served a bad one
            stored = [(f, self.receiver.peek(f.mm_hash)) for f in request.mm_features if f.data]
            bad = self._reject_embeds(stored)
            missing = miss.mm_hashes + [h for h in bad if h not in miss.mm_hashes]
            self._send_miss(request, MultiModalCacheMissError(missing))
            return
        except MMISError as exc:
            self._send_error(request, exc.to_wire())
            return
        except Exception as exc:  # e.g. an I/O error reading shared memory
            log.exception("resolving the items of %s failed", request.request_id)
            self._send_error(request, RequestError(ErrorCode.INTERNAL.value, str(exc)))
            return
        bad = self._reject_embeds(list(zip(request.mm_features, tensors, strict=True)))
        if bad:
            self._send_miss(request, MultiModalCacheMissError(bad))
            return
        self._publish_changes(request.client_index)
        features = [
            msgspec.structs.replace(feature, data=data)
            for feature, data in zip(request.mm_features, tensors, strict=True)
        ]
        self._core_queue.put(AddRequest(msgspec.structs.replace(request, mm_features=features)))

    def _reject_embeds(self, items: list[tuple[MultiModalFeature, Tensors | None]]) -> list[str]:
        """The hashes of the items whose encoder output fails its check
        (``engine/encoder_inputs.py``), each evicted from the receiver cache and announced (so
        no shadow keeps it and no later hit is served it) and counted by reason."""
        bad: list[str] = []
        for feature, data in items:
            # (checked here, not by a call: a request without one runs no encoder_inputs code)
            if data is None or MM_EMBEDS not in data or feature.mm_hash in bad:
                continue
            spec = self.embeds_spec
            rejection: Rejection | None
            if spec is None:
                rejection = Rejection("shape", "this engine takes no encoder outputs")
            else:
                rejection = check_embeds(data, feature.placeholder.length, spec, feature.mm_hash)
            if rejection is None:
                continue
            log.warning("refused an encoder output: %s", rejection.message)
            self.rejected[rejection.reason] += 1
            bad.append(feature.mm_hash)
        if bad:  # (counted among the receiver's fault_evictions: evicted on purpose)
            self.receiver.evict(bad, silent=False)
        return bad

    def _send_miss(self, request: EngineCoreRequest, miss: MultiModalCacheMissError) -> None:
        """Answer ``request`` as a receiver-cache miss naming ``miss.mm_hashes`` (retryable:
        P0's one drift retry resends them with their pixels)."""
        self._publish_changes(request.client_index)  # before the miss reaches P0
        out = EngineCoreOutput(
            request_id=request.request_id,
            finish_reason=FinishReason.ERROR.value,
            error=miss.to_wire(),
            missing_mm_hashes=miss.mm_hashes,
        )
        self._send(request.client_index, [out])

    def _receiver_stats(self) -> dict[str, int]:
        """The receiver cache's counters, plus the encoder outputs refused, by reason
        (``encoder_outputs_rejected_<reason>``)."""
        figures = dataclasses.asdict(self.receiver.stats())
        return figures | {f"encoder_outputs_rejected_{r}": n for r, n in self.rejected.items()}

    def _send_error(self, request: EngineCoreRequest, error: RequestError) -> None:
        out = EngineCoreOutput(
            request_id=request.request_id, finish_reason=FinishReason.ERROR.value, error=error
        )
        self._send(request.client_index, [out])

    def _publish_changes(self, origin: int | None) -> None:
        """Queue the receiver's stores and evictions since the last call for every client
        (its stores for all but ``origin``, the client whose request made them)."""
        self._out.publish(self.receiver.drain_stored(), self.receiver.drain_evicted(), origin)

    def utilities(self) -> dict[str, tuple[bool, Callable[..., Any]]]:
        """The one utility table: name -> (runs on the busy loop?, function)."""
        shell = {name: (False, fn) for name, fn in self._shell_utilities.items()}
        return shell | {name: (True, fn) for name, fn in self.core.utilities().items()}

    def _utility(self, call: UtilityCall) -> None:
        self._out.register(call.client_index)
        on_core, fn = self.utilities().get(call.method, (False, _unknown(call.method)))
        if call.method == MM_CACHE_SYNC:
            fn = functools.partial(fn, call.client_index)
        if on_core:
            self._core_queue.put(CoreUtility(call, fn))
        else:  # the shell's calls touch the receiver cache: they run here, on its thread
            self._answer(call, fn)

    def _hello(self) -> dict[str, Any]:
        lora = getattr(getattr(self.core, "runner", None), "lora", None)
        return {
            "cache_epoch": self.cache_epoch,
            "engine_index": self.engine_index,
            **self.model_info,
            # --max-loras with --enable-lora (P0's /stats/cache reports it)
            **({} if lora is None else {"max_loras": str(lora.table.max_loras)}),
        }

    def _reset_mm_cache(self) -> bool:
        self.receiver.clear()
        self._out.forget_all()  # stores of the old epoch must not reach any shadow
        self.cache_epoch = self.receiver.epoch  # P0 drops its whole shadow on the new epoch
        return True

    def _sync_shadow(self, client: int) -> int:
        """Queue a reset and the receiver's newest entries for ``client``; how many."""
        snapshot = self.receiver.snapshot(MAX_BACKLOG)
        self._out.resync(client, snapshot)
        return len(snapshot)

    def _set_fault(self, rate: float) -> float:
        if not 0.0 <= float(rate) <= 1.0:
            raise ValueError("fault evict rate must be within [0, 1]")
        self.fault_evict_rate = float(rate)
        log.warning("fault evict rate set to %.3f", self.fault_evict_rate)
        return self.fault_evict_rate

    def _answer(self, call: UtilityCall, fn: Callable[..., Any]) -> None:
        try:
            result = UtilityResult(call_id=call.call_id, ok=True, result=fn(*call.args))
        except Exception as exc:  # a failed utility call is answered, never fatal
            err = utility_error(call.method, exc)
            result = UtilityResult(call_id=call.call_id, ok=False, error=err)
        self._out.answer(call.client_index, result)

    # ---------------------------------------------------------------- busy loop
    def run(self) -> None:
        """Start the I/O threads and run the busy loop until :meth:`shutdown`."""
        self._loop_thread = threading.current_thread()
        tune_gc()
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

    def threads_alive(self) -> bool:
        """Whether the busy loop and the I/O threads all still run (the engine's probe,
        ``engine/health_server.py``); true before :meth:`run` started them."""
        loop = self._loop_thread
        if loop is not None and not loop.is_alive():
            return False
        return all(thread.is_alive() for thread in self._threads)

    def _drain_core_queue(self, block: bool) -> None:
        try:
            item = self._core_queue.get(timeout=0.1) if block else self._core_queue.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(item)
            try:
                item = self._core_queue.get_nowait()
            except queue.Empty:
                return

    def _apply(self, message: CoreMessage) -> None:
        match message:
            case AddRequest(request):
                self._owner[request.request_id] = request.client_index
                try:
                    self.core.add_request(request)
                except Exception as exc:  # admission answers bad input; this is an engine bug
                    log.exception("admitting %s failed", request.request_id)
                    self._owner.pop(request.request_id, None)
                    self._send_error(request, RequestError(ErrorCode.INTERNAL.value, str(exc)))
            case Abort(request_ids):
                self.core.abort_requests(request_ids)
                for rid in request_ids:  # aborted requests get no output: forget their owner
                    self._owner.pop(rid, None)
            case CoreUtility(call, fn):
                self._answer(call, fn)

    def _route(self, outputs: list[EngineCoreOutput]) -> None:
        by_client: defaultdict[int, list[EngineCoreOutput]] = defaultdict(list)
        for out in outputs:
            owner = self._owner.get(out.request_id, 0)
            if out.finish_reason is not None:
                self._owner.pop(out.request_id, None)
            by_client[owner].append(out)
        for client, outs in by_client.items():
            self._send(client, outs)

    # ---------------------------------------------------------------- to the clients
    def _send(self, client: int, outputs: list[EngineCoreOutput]) -> None:
        """The one funnel for request outputs (front-end test doubles hook it)."""
        self._out.send(client, outputs)
