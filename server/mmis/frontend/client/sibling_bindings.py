"""A uuid bound in one P0 resolves in every P0 of the pod (``--api-servers N``).

A client's ``uuid`` is bound to its content hash by the P0 that received the data
(:mod:`~mmis.frontend.client.tenancy`), and N P0s share one listening socket, so the request
naming the uuid alone may land on another process. That process then asks its siblings, on
their private unix sockets in the supervisor's 0700 run directory
(``frontend/api/api_server_group.py``), before answering the client.

Invariants:
- Asked only for a uuid-only item the asking process cannot resolve itself; at most
  :data:`ASK_TIMEOUT_S` per sibling, all siblings at once; a sibling that does not answer
  counts as not knowing.
- A sibling answers for the tenant the request authenticated as, never another
  (``UuidBindings.resolve``); the uuid and the tenant digest travel only between processes of
  the same pod, on sockets no other user can open (docs/SECURITY.md, "uuids per tenant").
- The answer binds the uuid here too (for that tenant), and when the sibling's shadow holds
  the content, its entry is learned through :class:`PendingInvalidations` (applied by the next
  render's drain, on the worker), so the render can send the item as a shadow hit at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import httpx

from mmis.protocol.messages import CachedItem

log = logging.getLogger(__name__)

ASK_TIMEOUT_S = 1.0
ROUTE = "/sibling/uuid_binding"
"""The route every P0 of N answers on its private socket only (``frontend/api/http_gate.py``)."""


class SiblingBindings:
    """The siblings' private sockets, asked for a binding this process lacks."""

    def __init__(self, socket_paths: Sequence[str]) -> None:
        self.socket_paths = list(socket_paths)
        self.asked = 0
        self.found = 0

    async def resolve(
        self, tenant: str, modality: str, uuid: str
    ) -> tuple[str, CachedItem | None] | None:
        """``(mm_hash, the sibling's shadow entry or None)`` from the first sibling that
        knows ``uuid`` for ``tenant``, else ``None``."""
        self.asked += 1
        body = {"tenant": tenant, "modality": modality, "uuid": uuid}
        answers = await asyncio.gather(*(self._ask(path, body) for path in self.socket_paths))
        for answer in answers:
            if answer is not None:
                self.found += 1
                return answer
        return None

    async def _ask(self, path: str, body: dict[str, str]) -> tuple[str, CachedItem | None] | None:
        transport = httpx.AsyncHTTPTransport(uds=path)
        try:
            async with httpx.AsyncClient(transport=transport, timeout=ASK_TIMEOUT_S) as client:
                answer = await client.post(f"http://p0{ROUTE}", json=body)
                answer.raise_for_status()
                data = answer.json()
        except (httpx.HTTPError, ValueError) as exc:  # restarting, hung, or not one of us
            log.info("sibling %s did not answer a uuid binding: %s", path, exc)
            return None
        mm_hash = data.get("mm_hash") if isinstance(data, dict) else None
        if not isinstance(mm_hash, str) or not mm_hash:
            return None
        entry = data.get("entry")
        item = None
        if (
            isinstance(entry, dict)
            and isinstance(entry.get("nbytes"), int)
            and isinstance(entry.get("placeholder_length"), int)
        ):
            item = CachedItem(mm_hash, entry["nbytes"], entry["placeholder_length"])
        return mm_hash, item
