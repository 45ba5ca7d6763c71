"""The client half of the ZMQ PLAIN credentials every token-guarded mmis socket checks (the
engine's event streams, ``mmis encoder``'s ROUTER): one helper for both sides, here because
the front end and the engine may not import each other.

Invariants:
- :data:`PLAIN_USER` is the one user name the engine's ZAP handler admits
  (``engine/event_auth.py`` ``ZapHandler``, whose ``USER`` is this); the password is the token.
- :func:`plain_client` only sets socket options (before ``connect``); the token is never
  logged.
"""

from __future__ import annotations

from typing import Any

import zmq

PLAIN_USER = b"mmis"


def plain_client(sock: zmq.Socket[Any], token: bytes | str) -> None:
    """Make ``sock`` (not yet connected) present user :data:`PLAIN_USER` with ``token``."""
    sock.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USER)
    sock.setsockopt(zmq.PLAIN_PASSWORD, token.encode() if isinstance(token, str) else token)
