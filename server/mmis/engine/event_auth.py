"""Who may open the engine's event sockets (docs/SECURITY.md, issue 41).

- With the events token (``--events-token``, from ``MMIS_ENGINE_EVENTS_TOKEN``) every event
  socket, PUB and replay ROUTER, is a ZMQ PLAIN server in the ZAP domain
  :data:`ZAP_DOMAIN`, and :class:`ZapHandler` (ZAP, RFC 27) admits user :data:`USER` with the
  token as password and nobody else. The picker presents exactly these (go-zeromq's PLAIN).
- Without a token an event socket may bind only where no other host reaches it
  (:func:`is_loopback`): ``127.0.0.0/8``, ``::1``, ``localhost``, ``ipc://``, ``inproc://``.
  The engine refuses any other bind at start-up (``engine/builder.py``).

Invariants:
- A PLAIN socket without a ZAP handler would be decided by libzmq alone (older libzmq admit
  anyone), so a publisher with a token holds a :class:`ZapHandler` on its context for as long
  as its sockets live; one handler per context, shared by every publisher there, all with the
  same token (a different one is refused).
- The handler admits only ``version 1.0``, domain :data:`ZAP_DOMAIN`, mechanism ``PLAIN``,
  user :data:`USER`, password equal to the token (compared in constant time). Anything else,
  malformed requests included, is answered ``400``. Sockets without a ZAP domain (the
  engine's own NULL sockets in the same context) never consult it (libzmq >= 4.3).
- The token never appears in a log line or an error message.
"""

from __future__ import annotations

import hmac
import ipaddress
import threading
from typing import ClassVar

import zmq

from mmis.protocol.zmq_auth import PLAIN_USER, plain_client

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks (RFC 27)
ZAP_DOMAIN = b"mmis-events"
USER = PLAIN_USER
LOCAL_TRANSPORTS = ("ipc", "inproc")
_POLL_MS = 100


class EventSocketError(ValueError):
    """An event socket this engine refuses to open as asked; the message says why."""


def is_loopback(endpoint: str) -> bool:
    """Whether binding ``endpoint`` keeps the socket on this host: ``ipc://``, ``inproc://``,
    or ``tcp://`` on ``127.0.0.0/8``, ``::1`` (``[::1]``) or ``localhost``. ``*``, an
    interface name, a host name or any other transport is not."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if scheme in LOCAL_TRANSPORTS:
        return True
    if scheme != "tcp" or ";" in rest:
        return False
    host, sep, _port = rest.rpartition(":")
    if not sep:
        return False
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def secure_server(sock: zmq.Socket[bytes], token: bytes | None) -> None:
    """Make ``sock`` (not yet bound) a PLAIN server in :data:`ZAP_DOMAIN` when there is a
    token; without one it stays NULL (loopback only, checked by the caller)."""
    if token is not None:
        sock.setsockopt(zmq.PLAIN_SERVER, 1)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)


secure_client = plain_client
"""The credentials an event subscriber presents (tests and tools; the picker's are Go):
``protocol/zmq_auth.py``'s, shared with P0's encoder clients."""


class ZapHandler:
    """The ZAP handler of one ZMQ context: a thread with a REP socket on :data:`ZAP_ENDPOINT`
    answering libzmq's authentication requests. Get it with :meth:`acquire` and give it back
    with :meth:`release`; the last release stops it."""

    _handlers: ClassVar[dict[int, ZapHandler]] = {}  # id(context) -> its handler
    _handlers_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], token: bytes) -> None:
        self.ctx = ctx
        self._token = token
        self.users = 0
        self.admitted = 0
        self.refused = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._serve, name="mmis-events-zap", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise EventSocketError(
                f"cannot answer authentication for the event sockets ({self._error}): "
                "another ZAP handler runs in this ZMQ context"
            )

    @classmethod
    def acquire(cls, ctx: zmq.Context[zmq.Socket[bytes]], token: bytes) -> ZapHandler:
        """The running handler of ``ctx`` (started now if there is none), counted as used."""
        with cls._handlers_lock:
            handler = cls._handlers.get(id(ctx))
            if handler is None or handler.ctx is not ctx:
                handler = cls(ctx, token)
                cls._handlers[id(ctx)] = handler
            elif not hmac.compare_digest(handler._token, token):
                raise EventSocketError("the event sockets of one process take one events token")
            handler.users += 1
            return handler

    def release(self) -> None:
        """One user fewer; the last one stops the thread and closes its socket."""
        with self._handlers_lock:
            self.users -= 1
            if self.users > 0:
                return
            if self._handlers.get(id(self.ctx)) is self:
                del self._handlers[id(self.ctx)]
        self._stop.set()
        self._thread.join(5 * _POLL_MS / 1000)

    def _admit(self, frames: list[bytes]) -> bool:
        if len(frames) != 8:  # version, id, domain, address, identity, mechanism, user, password
            return False
        version, _id, domain, _address, _identity, mechanism, user, password = frames
        ok = version == b"1.0" and domain == ZAP_DOMAIN and mechanism == b"PLAIN"
        # both compared whatever the other says: the answer's time tells nothing
        ok &= hmac.compare_digest(user, USER)
        ok &= hmac.compare_digest(password, self._token)
        return ok

    def _serve(self) -> None:
        try:
            sock = self.ctx.socket(zmq.REP)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(_POLL_MS):
                    continue
                frames = sock.recv_multipart()
                request_id = frames[1] if len(frames) > 1 else b""
                if self._admit(frames):
                    self.admitted += 1
                    sock.send_multipart((b"1.0", request_id, b"200", b"OK", USER, b""))
                else:
                    self.refused += 1
                    sock.send_multipart((b"1.0", request_id, b"400", b"refused", b"", b""))
        finally:
            sock.close(linger=0)
