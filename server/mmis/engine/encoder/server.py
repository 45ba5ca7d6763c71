"""The encoder's ZMQ ROUTER loop: :class:`~mmis.protocol.encoder.EncodeRequest` in,
:class:`~mmis.protocol.encoder.EncodeReply` out (the wire contract and the E/PD layout:
``protocol/encoder.py``).

One thread (:meth:`EncoderServer.run`) owns the ROUTER, the output cache and the event
stream. Each turn it takes every message waiting (up to :data:`TAKE_PER_TURN`), answers what
it can at once, hands one batch of what is left to the encode thread when that thread is idle,
finishes a batch that thread is done with (cache, replies), and flushes the cache's events.
The vision tower runs on that one encode thread, never on the ROUTER's: pings and cached items
are answered while a batch runs (P0 drops an encoder that misses 2 s of pings,
``frontend/client/encoder_pool.py``; a batch of real photos can take longer than that).

Invariants:
- Every message is ``[identity, (b"")?, body, *tensor_frames]`` decoded by
  :class:`~mmis.protocol.codec.WireCodec`; an empty delimiter frame (a REQ peer) is echoed
  in the reply. A message that does not decode as an ``EncodeRequest`` is dropped and
  counted (:attr:`EncoderServer.malformed`): there is no request id to answer. Nothing a peer
  sends ends the loop: any exception while handling one message is logged and counted.
- Bounded: one frame larger than ``max_message_bytes`` closes its connection inside libzmq
  (``ZMQ_MAXMSGSIZE``); a message whose frames add up to more is dropped unread past the
  limit and counted (:attr:`EncoderServer.oversized`); at most :data:`MAX_QUEUED_ITEMS` items
  wait to be encoded, beyond that an item is answered with a retryable error at once.
- A request whose key differs from the encoder's gets one whole-request error
  (``invalid_request``) naming each differing field and both values, and no items.
- A ping (no items) is answered at once with the encoder's key.
- Each item is answered exactly once, in the request's order, in ONE reply per request: a
  request whose items are all cached is answered at once (``cached=True``); otherwise when
  its last item is encoded. An item with the same ``mm_hash`` as one encoded in the same
  batch is served from that one encode (counted as cached).
- A batch is at most ``max_batch_items`` distinct items, in arrival order, and is ONE
  ``encode_images`` call; if it raises, its items are encoded one by one so that only the
  bad item gets the error (``invalid_request`` for input errors, ``internal_error`` else).
- An output is used only if it is 2-D with ``placeholder_length`` rows (from the cache too);
  otherwise the item gets an ``invalid_request`` error naming both counts. Good outputs are
  stored in the cache as contiguous host tensors and sent from there.
- One ``encode`` span per batch (``mmis.encoder.items``: its item count), the child of the
  first traced request in it and linked to every traced request's context; nothing when
  tracing is off.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import zmq

from mmis.engine.encoder.output_cache import OutputCache
from mmis.engine.event_auth import ZapHandler, secure_server
from mmis.protocol.codec import WireCodec
from mmis.protocol.encoder import EncodedItem, EncodeItem, EncodeReply, EncodeRequest, EncoderKey
from mmis.protocol.errors import MMISError
from mmis.protocol.messages import ErrorCode, RequestError

log = logging.getLogger("mmis.encoder")

TAKE_PER_TURN = 256  # messages read before the next batch runs
MAX_QUEUED_ITEMS = 1024  # items waiting to be encoded, at most
SPAN_NAME = "encode"
ATTR_ITEMS = "mmis.encoder.items"
_POLL_MS = 100
_BUSY_POLL_MS = 2  # the ROUTER's poll while a batch runs: how soon a finished one is seen

Encode = Callable[[Sequence[Mapping[str, Any]]], list[Any]]


def _error(code: ErrorCode, message: str, retryable: bool = False) -> RequestError:
    return RequestError(code=code.value, message=message, retryable=retryable)


def key_difference(asked: EncoderKey, served: EncoderKey) -> str:
    """What differs between two keys, field by field, naming both values."""
    parts = [
        f"{name} {getattr(asked, name)!r} (this encoder serves {getattr(served, name)!r})"
        for name in ("model", "revision", "dtype")
        if getattr(asked, name) != getattr(served, name)
    ]
    return "the request's key differs: " + "; ".join(parts)


def check_rows(output: Any, placeholder_length: int) -> RequestError | None:
    """None when ``output`` is ``[placeholder_length, hidden]``, else why not."""
    shape = tuple(getattr(output, "shape", ()))
    if len(shape) != 2 or shape[0] != placeholder_length:
        return _error(
            ErrorCode.INVALID_REQUEST,
            f"the encoder's output has shape {shape}, the item's placeholder_length is "
            f"{placeholder_length} rows",
        )
    return None


def _to_host(output: Any) -> Any:
    """A contiguous host copy (torch tensors); anything else as it is."""
    detach = getattr(output, "detach", None)
    if detach is None:
        return output
    return detach().to("cpu").contiguous()


def _nbytes(output: Any) -> int:
    nbytes = getattr(output, "nbytes", None)
    if nbytes is not None:
        return int(nbytes)
    return int(output.numel() * output.element_size())


@dataclasses.dataclass
class _Request:
    """One request with items waiting: its peer, the reply it will get, items not answered."""

    route: list[bytes]  # identity (+ the empty delimiter of a REQ peer)
    request: EncodeRequest
    answers: list[EncodedItem | None]
    left: int


@dataclasses.dataclass
class _Batch:
    """The batch on the encode thread: its items, who waits for each, its span, its future."""

    batch: list[EncodeItem]
    waiting: dict[str, list[tuple[_Request, int]]]
    span: Any
    future: concurrent.futures.Future[list[Any]]


@dataclasses.dataclass
class Counters:
    encoded: int = 0  # items encoded (one encode_images row each)
    cached: int = 0  # items answered from the cache (or from a twin in the same batch)
    errors: int = 0  # items answered with an error
    batches: int = 0
    requests: int = 0
    pings: int = 0
    wrong_key: int = 0
    malformed: int = 0
    oversized: int = 0
    dropped_replies: int = 0


class EncoderServer:
    """The ROUTER of one encoder. ``encode``: the adapter's ``encode_images``; ``events``: an
    :class:`~mmis.engine.event_publisher.EventStream` over the cache's listener, flushed
    each turn (or None); ``tracing``: a :class:`~mmis.telemetry.tracing.Tracing` (or None)."""

    def __init__(
        self,
        encode: Encode,
        key: EncoderKey,
        cache: OutputCache,
        *,
        endpoint: str,
        token: str | None = None,
        max_batch_items: int = 16,
        max_message_bytes: int = 512 << 20,
        tracing: Any = None,
        events: Any = None,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self._encode = encode
        self.key = key
        self.cache = cache
        self.max_batch_items = max_batch_items
        self.max_message_bytes = max_message_bytes
        self.tracing = tracing
        self.events = events
        self.counters = Counters()
        self._codec = WireCodec()
        self._queue: collections.deque[tuple[_Request, int]] = collections.deque()
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mmis-encode")
        self._running: _Batch | None = None  # the batch on the encode thread
        self._stop = threading.Event()
        self._ctx = ctx if ctx is not None else zmq.Context.instance()
        secret = token.encode() if token else None
        self._zap = ZapHandler.acquire(self._ctx, secret) if secret is not None else None
        self._sock = self._ctx.socket(zmq.ROUTER)
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
            secure_server(self._sock, secret)
            self._sock.bind(endpoint)
        except BaseException:
            self.close()
            raise
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until :meth:`stop`."""
        while not self._stop.is_set():
            if self._running is not None:  # answer what arrives while the batch runs
                wait_ms = _BUSY_POLL_MS
            elif self._queue:
                wait_ms = 0
            else:
                wait_ms = _POLL_MS
            if self._sock.poll(wait_ms):
                self._take()
            if self._running is not None and self._running.future.done():
                self._finish_batch()
            if self._running is None and self._queue:
                self._start_batch()
            if self.events is not None:
                self.events.flush()
        if self._running is not None:  # the batch in hand is answered before we return
            self._running.future.result()
            self._finish_batch()

    def stop(self) -> None:
        """Ask :meth:`run` to return (from any thread or a signal handler)."""
        self._stop.set()

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        self._sock.close(linger=0)
        if self._zap is not None:
            self._zap.release()
            self._zap = None

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def waiting(self) -> int:
        """Items to encode: queued plus the running batch (read from any thread: a scrape)."""
        running = self._running
        return len(self._queue) + (len(running.batch) if running is not None else 0)

    # -- messages ------------------------------------------------------------------------

    def _receive(self) -> tuple[list[bytes], list[Any]] | None:
        """One whole message (``(route, frames)``) or None when none is waiting; a message
        larger than the limit is read to its end, kept no further, and answered None."""
        try:
            identity = self._sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None
        frames: list[Any] = []
        total = 0
        while self._sock.getsockopt(zmq.RCVMORE):
            frame = self._sock.recv(copy=False)
            total += len(frame)
            if total <= self.max_message_bytes:
                frames.append(frame)
        if total > self.max_message_bytes:
            self.counters.oversized += 1
            log.warning("dropped a request of %d bytes (limit %d)", total, self.max_message_bytes)
            return [], []
        route = [identity]
        if frames and len(frames[0]) == 0:  # a REQ peer's delimiter
            route.append(b"")
            frames = frames[1:]
        return route, frames

    def _take(self) -> None:
        for _ in range(TAKE_PER_TURN):
            got = self._receive()
            if got is None:
                return
            route, frames = got
            if not route:
                continue
            try:
                self._handle(route, frames)
            except Exception:  # a peer's message never ends the loop
                self.counters.malformed += 1
                log.warning("could not handle a request", exc_info=True)

    def _handle(self, route: list[bytes], frames: Sequence[Any]) -> None:
        try:
            request = self._codec.decode(frames, EncodeRequest)
        except MMISError as exc:  # ProtocolError: nothing to answer
            self.counters.malformed += 1
            log.debug("malformed request dropped: %s", exc)
            return
        if request.key != self.key:
            self.counters.wrong_key += 1
            error = _error(ErrorCode.INVALID_REQUEST, key_difference(request.key, self.key))
            self._reply(route, EncodeReply(request.request_id, self.key, error=error))
            return
        if not request.items:
            self.counters.pings += 1
            self._reply(route, EncodeReply(request.request_id, self.key))
            return
        self.counters.requests += 1
        pending = _Request(route, request, [None] * len(request.items), len(request.items))
        for index, item in enumerate(request.items):
            problem = _item_problem(item)
            if problem is not None:
                self._answer(pending, index, EncodedItem(mm_hash=str(item.mm_hash), error=problem))
                continue
            hit = self.cache.get(self.key, item.mm_hash)
            if hit is not None:
                self._answer(pending, index, self._output(item, hit, cached=True))
            elif len(self._queue) >= MAX_QUEUED_ITEMS:
                busy = _error(ErrorCode.INTERNAL, "the encoder's queue is full", retryable=True)
                self._answer(pending, index, EncodedItem(mm_hash=item.mm_hash, error=busy))
            else:
                self._queue.append((pending, index))

    def _output(self, item: EncodeItem, output: Any, *, cached: bool) -> EncodedItem:
        problem = check_rows(output, item.placeholder_length)
        if problem is not None:
            return EncodedItem(mm_hash=item.mm_hash, error=problem)
        if cached:
            self.counters.cached += 1
        return EncodedItem(mm_hash=item.mm_hash, embeds=output, cached=cached)

    def _answer(self, pending: _Request, index: int, answer: EncodedItem) -> None:
        if answer.error is not None:
            self.counters.errors += 1
        pending.answers[index] = answer
        pending.left -= 1
        if pending.left == 0:
            items = [a for a in pending.answers if a is not None]
            self._reply(pending.route, EncodeReply(pending.request.request_id, self.key, items))

    def _reply(self, route: list[bytes], reply: EncodeReply) -> None:
        try:
            self._sock.send_multipart([*route, *self._codec.encode(reply)], zmq.NOBLOCK)
        except zmq.Again:  # the peer does not read: its reply is dropped, it times out
            self.counters.dropped_replies += 1

    # -- batches ---------------------------------------------------------------------------

    def _next_batch(self) -> tuple[list[EncodeItem], dict[str, list[tuple[_Request, int]]]]:
        """Up to ``max_batch_items`` distinct items from the queue's head, and every waiting
        answer each of them serves (a hash queued twice is encoded once)."""
        batch: list[EncodeItem] = []
        waiting: dict[str, list[tuple[_Request, int]]] = {}
        rest: collections.deque[tuple[_Request, int]] = collections.deque()
        while self._queue:
            pending, index = self._queue.popleft()
            item = pending.request.items[index]
            if item.mm_hash in waiting:
                waiting[item.mm_hash].append((pending, index))
            elif len(batch) < self.max_batch_items:
                hit = self.cache.get(self.key, item.mm_hash)  # stored since it was queued
                if hit is not None:
                    self._answer(pending, index, self._output(item, hit, cached=True))
                    continue
                batch.append(item)
                waiting[item.mm_hash] = [(pending, index)]
            else:
                rest.append((pending, index))
        self._queue = rest
        return batch, waiting

    def _start_batch(self) -> None:
        """Hand the next batch to the encode thread (the ROUTER thread goes on answering)."""
        batch, waiting = self._next_batch()
        if not batch:
            return
        self.counters.batches += 1
        span = self._span(batch, waiting)
        future = self._worker.submit(self._encode_on_worker, batch)
        self._running = _Batch(batch, waiting, span, future)

    def _encode_on_worker(self, batch: Sequence[EncodeItem]) -> list[Any]:
        """On the encode thread: the outputs (or errors) of ``batch``, on the host."""
        outputs = self._encode_isolating(batch)
        return [o if isinstance(o, RequestError) else _to_host(o) for o in outputs]

    def _finish_batch(self) -> None:
        """On the ROUTER thread: store and answer the batch the encode thread finished."""
        running, self._running = self._running, None
        if running is None:
            return
        try:
            outputs = running.future.result()
        except Exception as exc:  # _encode_isolating catches the tower's own errors
            outputs = [_failure(exc)] * len(running.batch)
        finally:
            if running.span is not None:
                running.span.end()
        self._answer_batch(running.batch, running.waiting, outputs)

    def _answer_batch(
        self,
        batch: Sequence[EncodeItem],
        waiting: Mapping[str, list[tuple[_Request, int]]],
        outputs: Sequence[Any],
    ) -> None:
        for item, output in zip(batch, outputs, strict=True):
            answers = waiting[item.mm_hash]
            if isinstance(output, RequestError):
                for pending, index in answers:
                    self._answer(pending, index, EncodedItem(mm_hash=item.mm_hash, error=output))
                continue
            self.counters.encoded += 1
            host = output
            first = self._output(item, host, cached=False)
            if first.error is None:
                self.cache.put(self.key, item.mm_hash, host, _nbytes(host))
            (pending, index), twins = answers[0], answers[1:]
            self._answer(pending, index, first)
            for pending, index in twins:
                twin = pending.request.items[index]
                self._answer(pending, index, self._output(twin, host, cached=True))

    def _encode_isolating(self, batch: Sequence[EncodeItem]) -> list[Any]:
        """One ``encode`` call for the batch; if it fails, one call per item, so only the
        bad items get an error (a :class:`RequestError` in place of their output)."""
        try:
            return self._encode_checked(batch)
        except Exception as exc:
            if len(batch) == 1:
                return [_failure(exc)]
            log.info("a batch of %d failed (%s): encoding its items one by one", len(batch), exc)
        out: list[Any] = []
        for item in batch:
            try:
                out.extend(self._encode_checked([item]))
            except Exception as exc:
                out.append(_failure(exc))
        return out

    def _encode_checked(self, batch: Sequence[EncodeItem]) -> list[Any]:
        outputs = list(self._encode([item.data for item in batch]))
        if len(outputs) != len(batch):
            raise RuntimeError(f"the encoder returned {len(outputs)} outputs for {len(batch)}")
        return outputs

    def _span(
        self, batch: Sequence[EncodeItem], waiting: Mapping[str, Sequence[tuple[_Request, int]]]
    ) -> Any:
        """The batch's ``encode`` span, started (never made current: the ROUTER thread goes on
        with other messages while it runs); ended by :meth:`_finish_batch`. None untraced."""
        tracing = self.tracing
        if tracing is None or not tracing.enabled:
            return None
        from opentelemetry import trace

        from mmis.telemetry.tracing import extract

        contexts = []
        seen: set[int] = set()
        for answers in waiting.values():
            for pending, _ in answers:
                if id(pending) not in seen and pending.request.trace_context:
                    seen.add(id(pending))
                    contexts.append(extract(pending.request.trace_context))
        links = [
            trace.Link(span_context)
            for span_context in (trace.get_current_span(c).get_span_context() for c in contexts)
            if span_context.is_valid
        ]
        return tracing.tracer.start_span(
            SPAN_NAME,
            context=contexts[0] if contexts else None,
            links=links,
            attributes={ATTR_ITEMS: len(batch)},
        )


def _item_problem(item: EncodeItem) -> RequestError | None:
    if not isinstance(item.mm_hash, str) or not item.mm_hash:
        return _error(ErrorCode.INVALID_REQUEST, "an item needs a non-empty mm_hash")
    if item.placeholder_length <= 0:
        return _error(
            ErrorCode.INVALID_REQUEST,
            f"placeholder_length must be > 0, got {item.placeholder_length}",
        )
    if not item.data:
        return _error(ErrorCode.INVALID_REQUEST, "an item to encode needs its processor tensors")
    return None


def _failure(exc: BaseException) -> RequestError:
    text = " ".join(str(exc).split())[:500] or type(exc).__name__
    if isinstance(exc, MMISError):
        return RequestError(code=exc.code, message=text, retryable=exc.retryable)
    if isinstance(exc, ValueError | TypeError | IndexError | KeyError):
        return _error(ErrorCode.INVALID_REQUEST, f"the item's tensors cannot be encoded: {text}")
    return _error(ErrorCode.INTERNAL, f"encoding failed: {text}")
