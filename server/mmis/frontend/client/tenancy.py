"""Tenants and their uuid bindings: a client-chosen ``uuid`` never leaves P0.

A *tenant* is who a request authenticated as (docs/SECURITY.md, "uuids per tenant"):

- the API key it presented (``--api-key`` takes several keys, separated by commas; each is a
  tenant), named by :func:`key_tenant`, a digest of the key: the key itself is never kept;
- or, with ``--tenant-header NAME``, that header's value (the gateway in front authenticates
  clients and overwrites it), named by :func:`header_tenant`, a digest of the value;
- otherwise :data:`ANONYMOUS`: without keys and without the header every client is one tenant.

The HTTP gate (:mod:`mmis.frontend.api.http_gate`) decides a request's tenant from its
headers alone; ``None`` means "no tenant can be named" (an ``/internal/*`` request with API
keys configured: its ``Authorization`` carries the internal token), and such a request can
resolve no uuid.

:class:`UuidBindings` is P0's table ``(tenant, modality, uuid) -> mm_hash``:

- An item sent with data is keyed by the hash of its content (:mod:`mmis.multimodal.hashing`),
  whatever uuid it carries, and :meth:`UuidBindings.bind` binds that uuid, for the sender's
  tenant, to the content hash. New data under a bound uuid *rebinds* it (``bind`` returns
  ``True``; P0 counts it in ``mmis:uuid_rebinds_total``); the earlier content is untouched.
- An item sent by uuid alone resolves through the sender's tenant's binding
  (:meth:`UuidBindings.resolve`); another tenant's binding is invisible, so no tenant can
  read an item by guessing its uuid, nor poison one by sending other data under it.
- Bounded: at most :data:`MAX_BINDINGS` bindings, the least recently bound or resolved
  forgotten first (an unknown binding is the retryable 422 of a uuid-only item: resend it
  with data). A binding costs at most a few hundred bytes (uuids are at most 256 characters),
  so the table stays under ~10 MiB.
- Only the asyncio event loop touches the table (``Renderer.prepare``), so it has no lock.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Final

ANONYMOUS: Final = "anonymous"
"""The one tenant of a server without API keys and without a tenant header."""

MAX_BINDINGS: Final = 16384
"""Most uuid bindings P0 keeps (all tenants together), least recently used forgotten first."""


def _digest(kind: str, value: str) -> str:
    return kind + ":" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def key_tenant(api_key: str) -> str:
    """The tenant id of an API key: a digest, never the key."""
    return _digest("key", api_key)


def header_tenant(value: str) -> str:
    """The tenant id of a tenant header's value (a namespace apart from the keys')."""
    return _digest("header", value)


class UuidBindings:
    """``(tenant, modality, uuid) -> mm_hash``, an LRU of at most ``capacity`` entries."""

    def __init__(self, capacity: int = MAX_BINDINGS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._table: OrderedDict[tuple[str, str, str], str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def bind(self, tenant: str, modality: str, uuid: str, mm_hash: str) -> bool:
        """Bind ``uuid`` to ``mm_hash`` for ``tenant``; ``True`` when it was bound to other
        content before (a rebind)."""
        key = (tenant, modality, uuid)
        previous = self._table.pop(key, None)
        self._table[key] = mm_hash
        while len(self._table) > self.capacity:
            self._table.popitem(last=False)
        return previous is not None and previous != mm_hash

    def resolve(self, tenant: str | None, modality: str, uuid: str) -> str | None:
        """The content hash ``tenant`` bound ``uuid`` to, or ``None`` (no such binding)."""
        if tenant is None:
            return None
        key = (tenant, modality, uuid)
        mm_hash = self._table.get(key)
        if mm_hash is not None:
            self._table.move_to_end(key)
        return mm_hash
