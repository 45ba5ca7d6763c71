"""P0's encoders (E/PD, issue 46): the live set, which one encodes an item, and the asks.

An :class:`EncoderPool` holds one ``zmq.asyncio`` DEALER per encoder (``mmis encoder
--endpoint``, a ROUTER), from ``--encoder-urls`` and the A records of ``--encoder-service
HOST:PORT`` (a headless Service: re-resolved every :data:`RESOLVE_INTERVAL_S` with the event
loop's resolver; an address gone from DNS is closed, a new one connected). Every encoder is
pinged every ``ping_interval_s`` (an :class:`EncodeRequest` with no items); an encoder is
*live* while its latest answer (to anything) is at most ``down_after_s`` old. An item goes to
the live encoder that rendezvous hashing of its ``mm_hash`` picks
(:mod:`~mmis.frontend.client.rendezvous`), so a repeated image reaches the encoder that holds
its output, and the items of a dead encoder move to the next one (and only those).

:meth:`EncoderPool.fetch` sends one :class:`EncodeRequest` per encoder with that encoder's
items and awaits the replies, all within ``timeout_s``. What it returns are the outputs it
can use; every other item is a *fallback* (P0 sends its pixels, P1 encodes it locally), with
one reason: ``timeout`` (no reply in time), ``down`` (the encoder refused the send or left the
live set while P0 waited), ``error`` (an error reply or item), ``mislabelled`` (the reply's
key is not P0's, or the item was not in the reply under the hash asked), ``none_live``.

Invariants:
- Never raises for an encoder's sake: the worst case is every item a fallback.
- Keys: P0 knows the model and revision (``--model``, ``--revision``: ``mmis encoder`` must be
  started with the same strings); the dtype is the encoder's, learnt from its answers (a ping
  under P0's bare key gets the encoder's key back, an error reply included). An encoder is
  live only once it answered under P0's model and revision; an encoder of another model never
  is. Items are asked under the key the encoder announced.
- A reply is used only when its ``request_id`` is one P0 is waiting for, its key equals the
  key asked (P1 checks the dtype against its own), and each output sits under the hash P0
  asked; an output under any other hash is dropped, never relayed.
- Counted per item: ``mmis_encoder_requests_total{outcome=ok|cached|fallback}`` and, for each
  fallback, ``mmis_encoder_fallbacks_total{reason}``; each fallback reason of a fetch is one
  ``encoder_fallback`` event (reason, item count) on the current span (the render span).
- No client data but the item tensors, their hashes and the trace context reaches an encoder
  (``protocol/encoder.py``); ``request_id`` is this pool's own counter.
- Off loopback an encoder needs the token: with ``token`` (``MMIS_ENCODER_TOKEN``) every
  DEALER is a ZMQ PLAIN client as user ``mmis`` (the name the engine's ZAP handler
  admits, ``engine/event_auth.py``), set by ``protocol/zmq_auth.py``'s :func:`plain_client`,
  the helper the engine's event clients use too.
  The token never appears in a log line.
- Only the event loop touches the pool; the render worker never waits on it.
- An encoder's bytes are bounded and never trusted: a frame over :data:`MAX_REPLY_FRAME_BYTES`
  closes the connection inside libzmq (``ZMQ_MAXMSGSIZE``); a reply that does not decode, or
  whose handling raises, is dropped and counted (:attr:`EncoderPool.bad_replies`) and the
  receive loop goes on (a dead loop would silently retire a live encoder); an output is relayed
  only if it is a 2-D numeric array or tensor with the placeholder's row count, else that item
  is an ``error`` fallback (P1 checks the rest: dtype, columns, finite values).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import zmq
import zmq.asyncio
from opentelemetry import trace

from mmis.frontend.client import rendezvous
from mmis.protocol.codec import WireCodec
from mmis.protocol.encoder import EncodedItem, EncodeItem, EncodeReply, EncodeRequest, EncoderKey
from mmis.protocol.errors import ProtocolError
from mmis.protocol.zmq_auth import plain_client
from mmis.telemetry.metrics import MMISMetrics

log = logging.getLogger(__name__)

RESOLVE_INTERVAL_S = 5.0
SEND_HWM = 64  # messages queued per encoder before a send is refused ("down")
MAX_REPLY_FRAME_BYTES = 1 << 30
"""The largest frame P0 reads from an encoder: one item's output (a 32k-token placeholder of
hidden 8192 in float32 is 1 GiB); libzmq closes a connection that sends more."""
FALLBACK_EVENT = "encoder_fallback"
ATTR_REASON = "mmis.encoder.reason"
ATTR_ITEMS = "mmis.mm.hashes_count"

TIMEOUT, DOWN, ERROR, MISLABELLED, NONE_LIVE = (
    "timeout",
    "down",
    "error",
    "mislabelled",
    "none_live",
)


class EncoderPoolError(ValueError):
    """A pool configured wrongly (a bad URL or service name); the message names the flag."""


def parse_service(service: str) -> tuple[str, int]:
    """``HOST:PORT`` of ``--encoder-service`` as (host, port); :class:`EncoderPoolError` if not."""
    host, sep, port = service.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EncoderPoolError(f"--encoder-service {service!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def check_url(url: str) -> str:
    """A ``tcp://HOST:PORT`` of ``--encoder-urls``; :class:`EncoderPoolError` if not."""
    scheme, sep, rest = url.partition("://")
    host, colon, port = rest.rpartition(":")
    if scheme != "tcp" or not sep or not colon or not host or not port.isdigit():
        raise EncoderPoolError(f"--encoder-urls: {url!r} is not tcp://HOST:PORT")
    return url


@dataclasses.dataclass
class FetchResult:
    """What a fetch brought: usable outputs by hash, and the reason of every other item."""

    embeds: dict[str, Any]
    fallbacks: dict[str, str]


class _Encoder:
    """One encoder: its DEALER, the asks awaiting an answer, when it last answered."""

    def __init__(self, url: str, sock: zmq.asyncio.Socket) -> None:
        self.url = url
        self.sock = sock
        self.pending: dict[int, asyncio.Future[EncodeReply]] = {}
        self.last_answer: float | None = None  # monotonic; None: never answered
        self.key: EncoderKey | None = None  # the key it answers with (P0's model and revision)
        self.task: asyncio.Task[None] | None = None

    def fail_pending(self, reason: str) -> None:
        for future in list(self.pending.values()):
            if not future.done():
                future.set_exception(_Failed(reason))
        self.pending.clear()


class _Failed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EncoderPool:
    """The live encoders of one P0 (see the module docstring). :meth:`start` in the event loop,
    :meth:`close` when done."""

    def __init__(
        self,
        key: EncoderKey,
        *,
        urls: Sequence[str] = (),
        service: str | None = None,
        timeout_s: float = 5.0,
        token: str | None = None,
        metrics: MMISMetrics | None = None,
        ping_interval_s: float = 1.0,
        down_after_s: float = 2.0,
        resolve_interval_s: float = RESOLVE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.key = key
        self.urls = tuple(check_url(u) for u in urls)
        self.service = parse_service(service) if service else None
        if not self.urls and self.service is None:
            raise EncoderPoolError("an encoder pool needs --encoder-urls or --encoder-service")
        self.timeout_s = timeout_s
        self._token = token.encode() if token else None
        self.metrics = metrics
        self.bad_replies = 0  # replies dropped: undecodable or failing their handling
        self.ping_interval_s = ping_interval_s
        self.down_after_s = down_after_s
        self.resolve_interval_s = resolve_interval_s
        self._clock = clock
        self._codec = WireCodec()
        self._ctx: zmq.asyncio.Context | None = None
        self._encoders: dict[str, _Encoder] = {}
        self._ids = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []
        self._resolved: tuple[str, ...] = ()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Connect the static URLs, resolve the service once, start pinging, and wait (at
        most ``down_after_s``) for every encoder's first answer, so that the first renders
        (the readiness probe's among them) find the encoders already live."""
        self._ctx = zmq.asyncio.Context()
        if self.service is not None:
            self._resolved = await self._resolve()
        self._sync(self.urls + self._resolved)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._ping_loop(), name="mmis-encoder-ping"))
        if self.service is not None:
            self._tasks.append(loop.create_task(self._resolve_loop(), name="mmis-encoder-dns"))
        deadline = loop.time() + self.down_after_s
        while loop.time() < deadline and any(e.key is None for e in self._encoders.values()):
            await asyncio.sleep(0.02)  # bounded wait for the first pongs (another process)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        for url in list(self._encoders):
            await self._drop(url)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # ------------------------------------------------------------------ the live set
    def members(self) -> list[str]:
        """Every encoder P0 talks to, live or not."""
        return sorted(self._encoders)

    def live(self) -> list[str]:
        """The encoders whose latest answer is at most ``down_after_s`` old."""
        now = self._clock()
        return sorted(
            url
            for url, enc in self._encoders.items()
            if enc.key is not None
            and enc.last_answer is not None
            and now - enc.last_answer <= self.down_after_s
        )

    def owner(self, mm_hash: str) -> str | None:
        """The live encoder rendezvous hashing gives ``mm_hash`` (None: none live)."""
        return rendezvous.pick(mm_hash, self.live())

    def _sync(self, urls: Sequence[str]) -> None:
        """Connect the encoders of ``urls`` not yet connected (closing the others is
        :meth:`_resolve_loop`'s)."""
        if self._ctx is None:
            raise RuntimeError("EncoderPool.start() first")
        for url in urls:
            if url in self._encoders:
                continue
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only on a live connection
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_FRAME_BYTES)
            if self._token is not None:
                plain_client(sock, self._token)
            sock.connect(url)
            enc = _Encoder(url, sock)
            enc.task = asyncio.get_running_loop().create_task(
                self._receive(enc), name=f"mmis-encoder-recv {url}"
            )
            self._encoders[url] = enc
            log.info("encoder %s joined the pool", url)

    async def _drop(self, url: str) -> None:
        enc = self._encoders.pop(url, None)
        if enc is None:
            return
        enc.fail_pending(DOWN)
        if enc.task is not None:
            enc.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await enc.task
        enc.sock.close(linger=0)
        log.info("encoder %s left the pool", url)

    async def _resolve(self) -> tuple[str, ...]:
        """``tcp://ADDR:PORT`` for each address of the service (empty when it resolves to
        nothing or not at all: the static URLs still serve)."""
        if self.service is None:
            return ()
        host, port = self.service
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("encoder service %s:%d does not resolve: %s", host, port, exc)
            return ()
        out = []
        for _family, _type, _proto, _name, sockaddr in infos:
            address = str(sockaddr[0])
            out.append(f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}")
        return tuple(sorted(set(out)))

    async def _resolve_loop(self) -> None:
        while True:
            await asyncio.sleep(self.resolve_interval_s)
            resolved = await self._resolve()
            if not resolved and self._resolved:
                continue  # a DNS hiccup: keep the addresses known so far
            self._resolved = resolved
            wanted = set(self.urls) | set(resolved)
            for url in [u for u in self._encoders if u not in wanted]:
                await self._drop(url)
            self._sync(sorted(wanted))

    async def _ping_loop(self) -> None:
        while True:
            now = self._clock()
            for enc in list(self._encoders.values()):
                stale = enc.last_answer is None or now - enc.last_answer > self.down_after_s
                if stale and enc.pending:  # out of the set: nobody waits on it any longer
                    enc.fail_pending(DOWN)
                request = EncodeRequest(request_id=next(self._ids), key=enc.key or self.key)
                self._send(enc, request)
            await asyncio.sleep(self.ping_interval_s)

    def _send(self, enc: _Encoder, request: EncodeRequest) -> bool:
        try:
            frames = self._codec.encode(request)
            # NOBLOCK: zmq.asyncio tries at once, so the future is done (an error: no peer)
            sent = enc.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            if isinstance(sent, asyncio.Future) and sent.done():
                failure = sent.exception()
                if failure is not None:
                    raise failure
        except zmq.Again:
            return False
        except (zmq.ZMQError, ProtocolError) as exc:
            log.warning("encoder %s: send failed: %s", enc.url, exc)
            return False
        return True

    async def _receive(self, enc: _Encoder) -> None:
        while True:
            frames = await enc.sock.recv_multipart(copy=False)
            try:
                self._on_reply(enc, frames)
            except Exception as exc:  # an encoder's bytes never end the loop
                self.bad_replies += 1
                log.warning("encoder %s: reply dropped: %s", enc.url, str(exc)[:200])

    def _on_reply(self, enc: _Encoder, frames: Sequence[Any]) -> None:
        reply = self._codec.decode([f.buffer for f in frames], EncodeReply)
        if self._serves_ours(reply.key):  # an answer (even an error) under our model
            if enc.key != reply.key:
                log.info("encoder %s serves %s", enc.url, reply.key)
            enc.key = reply.key
            enc.last_answer = self._clock()
        elif enc.key is None:
            log.warning(
                "encoder %s serves model %r revision %r, not this P0's %r %r: not used",
                enc.url,
                reply.key.model,
                reply.key.revision,
                self.key.model,
                self.key.revision,
            )
        future = enc.pending.pop(reply.request_id, None)
        if future is not None and not future.done():
            future.set_result(reply)

    # ------------------------------------------------------------------ fetch
    async def fetch(
        self, items: Sequence[EncodeItem], trace_context: Mapping[str, str] | None = None
    ) -> FetchResult:
        """The encoder outputs of ``items`` (by ``mm_hash``) that P0 may relay, and why each
        other item falls back (see the module docstring). Awaits at most ``timeout_s``."""
        result = FetchResult({}, {})
        if not items:
            return result
        live = self.live()
        groups: dict[str, list[EncodeItem]] = {}
        for item in items:
            url = rendezvous.pick(item.mm_hash, live)
            if url is None:
                result.fallbacks[item.mm_hash] = NONE_LIVE
            else:
                groups.setdefault(url, []).append(item)
        asks: dict[asyncio.Future[EncodeReply], tuple[_Encoder, EncodeRequest, list[EncodeItem]]]
        asks = {}
        loop = asyncio.get_running_loop()
        for url, group in groups.items():
            enc = self._encoders[url]
            request = EncodeRequest(
                request_id=next(self._ids),
                key=enc.key or self.key,
                items=group,
                trace_context=dict(trace_context or {}),
            )
            future: asyncio.Future[EncodeReply] = loop.create_future()
            enc.pending[request.request_id] = future
            if not self._send(enc, request):
                enc.pending.pop(request.request_id, None)
                future.cancel()
                result.fallbacks.update((i.mm_hash, DOWN) for i in group)
                continue
            asks[future] = (enc, request, group)
        try:
            if asks:
                await asyncio.wait(list(asks), timeout=self.timeout_s)
        finally:
            for future, (enc, request, group) in asks.items():
                enc.pending.pop(request.request_id, None)
                if not future.done():
                    future.cancel()
                    result.fallbacks.update((i.mm_hash, TIMEOUT) for i in group)
                elif future.cancelled():
                    result.fallbacks.update((i.mm_hash, DOWN) for i in group)
                elif (exc := future.exception()) is not None:
                    reason = exc.reason if isinstance(exc, _Failed) else ERROR
                    result.fallbacks.update((i.mm_hash, reason) for i in group)
                else:
                    self._take(future.result(), request.key, group, result)
        self._count(result)
        return result

    def _serves_ours(self, key: EncoderKey) -> bool:
        return key.model == self.key.model and key.revision == self.key.revision

    def _take(
        self,
        reply: EncodeReply,
        asked: EncoderKey,
        group: Sequence[EncodeItem],
        result: FetchResult,
    ) -> None:
        """The outputs of one reply P0 may use into ``result``; every other item of ``group``
        a fallback with its reason."""
        if not self._serves_ours(reply.key) or reply.key != asked:
            result.fallbacks.update((i.mm_hash, MISLABELLED) for i in group)
            return
        if reply.error is not None:
            result.fallbacks.update((i.mm_hash, ERROR) for i in group)
            return
        answered: dict[str, EncodedItem] = {}
        for encoded in reply.items:
            answered.setdefault(encoded.mm_hash, encoded)  # a hash not asked is never looked up
        for item in group:
            out = answered.get(item.mm_hash)
            if out is None:
                result.fallbacks[item.mm_hash] = MISLABELLED
            elif out.error is not None or not _usable(out.embeds, item.placeholder_length):
                result.fallbacks[item.mm_hash] = ERROR
            else:
                result.embeds[item.mm_hash] = out.embeds
                if self.metrics is not None:
                    self.metrics.encoder_request("cached" if out.cached else "ok")

    def _count(self, result: FetchResult) -> None:
        reasons: dict[str, int] = {}
        for reason in result.fallbacks.values():
            reasons[reason] = reasons.get(reason, 0) + 1
        span = trace.get_current_span()
        for reason, count in sorted(reasons.items()):
            if self.metrics is not None:
                self.metrics.encoder_fallback(reason, count)
            if span.is_recording():
                span.add_event(FALLBACK_EVENT, {ATTR_REASON: reason, ATTR_ITEMS: count})


def _usable(embeds: Any, rows: int) -> bool:
    """Whether an encoder's output may be relayed: a 2-D numeric numpy array or torch tensor
    with ``rows`` rows (P1 checks the dtype, the columns and the values:
    engine/encoder_inputs.py)."""
    shape = getattr(embeds, "shape", None)
    dtype = str(getattr(embeds, "dtype", ""))
    if shape is None or len(shape) != 2 or int(shape[0]) != rows:
        return False
    if isinstance(embeds, np.ndarray):
        return embeds.dtype.kind in "fiu"
    return type(embeds).__module__.startswith("torch") and dtype.startswith("torch.")
