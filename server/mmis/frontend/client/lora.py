"""P0's view of the engine's LoRA adapters (issue 47): what a request's ``model`` may name
beside the base model, the ids P0 assigns, and the engine utility calls that load and unload
them (``engine/lora/``: ``load_lora_adapter(name, lora_id, path)``,
``unload_lora_adapter(name)``, ``list_lora_adapters()``).

Invariants:
- The engine's list is the source of truth. This registry is a cache of it: a name it does not
  know is looked up in the engine (``list_lora_adapters``) before it is called unknown, so an
  adapter loaded through a sibling P0 (``--api-servers N``) or before this P0 restarted is
  served here too; an unload through a sibling is seen when the engine refuses the adapter
  (:meth:`LoRARegistry.forget`), and ``GET /v1/models`` lists the engine's list. Nothing else
  is shared between siblings.
- An adapter's ``lora_id`` is never reused in the engine's life (prefix-cache blocks are keyed
  by it: ``protocol/block_keys.py``): this P0 picks ids ``client_index + 1 + k * api_servers``
  above every id it has seen, so siblings never pick the same one, and an id the engine says was
  used before (this P0 restarted) is skipped for the next.
- Loads and unloads come two ways (``api/lora_routes.py``): vLLM's ``/v1`` routes (:meth:`load` /
  :meth:`unload`: a name already loaded is a 400, an unknown one a 404) and the operator's
  internal routes, which reconcile (:meth:`ensure_loaded` / :meth:`ensure_unloaded`: the
  engine's list is asked first; a name loaded from the same path is a success, from another
  path a 409 :class:`LoRAConflictError` ``lora_already_loaded``; unloading a name the engine
  does not hold is a success). Both go through :meth:`load` / :meth:`unload`: one owner.
- ``lora_path`` may be a hub id, ``hf://<org>/<name>[@<revision>]``
  (``client/lora_hub.py``): P0 downloads the adapter's files into the HF cache on a worker
  thread (the engine's loop never waits on the network), then hands the engine the id, which
  the engine reads from that cache alone (``engine/lora/adapter.py``; the pod's containers
  share ``HF_HOME``) and lists as the adapter's path. A
  malformed id, an unreachable hub, a missing repo or revision is a 400 naming the cause, and
  nothing reaches the engine.
- A refusal keeps its cause: the engine's message (``"load_lora_adapter: LoRA adapter 'x':
  rank 32 exceeds ..."``) without the method prefix, as a 400 :class:`LoRAAdapterError`; an
  unknown adapter is a 404 :class:`LoRANotFoundError` (``model_not_found``); one that a live
  request uses is a 409 :class:`LoRAInUseError`; an engine without ``--enable-lora`` is a 400
  saying so. Nothing is half-registered: the registry changes only after the engine answered.
- What a refusal means is read from its wire code alone (``ErrorCode``: ``lora_id_reused``,
  ``lora_already_loaded``, ``lora_not_loaded``, ``lora_in_use``, ``unknown_utility``; the
  engine's typed errors, ``engine/lora/errors.py``), never from its message text.
- ``--lora-modules`` entries are ``NAME=PATH`` or vLLM's JSON form ``{"name": ..., "path":
  ...}`` (:func:`parse_lora_module`); at start-up each is loaded (or adopted, when the engine
  already holds that name: a sibling or an earlier P0 loaded it), and a bad one is a one-line
  :class:`~mmis.config.StartupError` naming the adapter and the cause. After the engine
  restarts (a new cache epoch) every adapter this P0 knows is loaded again under its id.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any

from mmis.config import StartupError
from mmis.frontend.client.engine_client import EngineClient, UtilityCallError
from mmis.frontend.client.lora_hub import HubSourceError, download, parse_hub_source
from mmis.frontend.config import parse_lora_module
from mmis.frontend.errors import FrontendError
from mmis.protocol.messages import ErrorCode

log = logging.getLogger(__name__)

LOAD, UNLOAD, LIST = "load_lora_adapter", "unload_lora_adapter", "list_lora_adapters"
_MAX_ID_TRIES = 64  # ids the engine says were used before, skipped before giving up


class LoRAAdapterError(FrontendError):
    """An adapter that cannot be loaded (rank over ``--max-lora-rank``, missing or corrupt
    files, target modules the model lacks, a name already loaded, LoRA off): 400."""


class LoRANameTakenError(LoRAAdapterError):
    """A load under a name the engine already holds (vLLM's 400 on the ``/v1`` route);
    ``held_path``: the path it holds that name from, when known."""

    def __init__(self, message: str, *, held_path: str | None = None) -> None:
        super().__init__(message, param="lora_name")
        self.held_path = held_path


class LoRAConflictError(FrontendError):
    """A reconciling (internal) load of a name the engine holds from another path: 409
    ``lora_already_loaded`` (unload it first)."""

    status = 409
    code = "lora_already_loaded"


class LoRANotFoundError(FrontendError):
    """An adapter name the engine does not hold: 404 ``model_not_found`` (vLLM's answer)."""

    status = 404
    code = "model_not_found"


class LoRAInUseError(FrontendError):
    """An unload refused because a live request runs under the adapter: 409."""

    status = 409
    code = "lora_adapter_in_use"


@dataclasses.dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """One adapter the engine holds: its name (a request's ``model``), id and PEFT path."""

    name: str
    lora_id: int
    path: str
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


def _cause(exc: BaseException, method: str) -> str:
    """The engine's message without its ``method: `` prefix (it starts with the cause), for
    the client to read; what the refusal means is its code."""
    return str(exc).removeprefix(f"{method}: ")


class LoRARegistry:
    """The adapters of one P0 (the module's invariants). ``client``: the engine link;
    ``modules``: ``--lora-modules``; ``index`` / ``stride``: this P0's place among
    ``--api-servers`` siblings (its id sequence)."""

    def __init__(
        self, client: EngineClient, modules: Iterable[str] = (), *, index: int = 0, stride: int = 1
    ) -> None:
        self._client = client
        self.modules = [parse_lora_module(m) for m in modules]
        self._adapters: dict[str, LoRAAdapter] = {}
        self._index, self._stride = index, max(stride, 1)
        self._round = 0  # the next id is index + 1 + round * stride
        self._lock = asyncio.Lock()  # loads and unloads of this P0 one at a time
        self._reload: asyncio.Task[None] | None = None
        self.enabled = False  # whether the engine serves LoRA (learned by :meth:`start`)

    # ------------------------------------------------------------------ reading
    def get(self, name: str | None) -> LoRAAdapter | None:
        return None if name is None else self._adapters.get(name)

    def adapters(self) -> list[LoRAAdapter]:
        return sorted(self._adapters.values(), key=lambda a: a.lora_id)

    async def resolve(self, name: str) -> LoRAAdapter | None:
        """The adapter ``name`` names, asking the engine when this P0 does not know it (a
        sibling may have loaded it); None when the engine does not hold it either or runs
        without LoRA (then it is not asked). An engine that is down is its 503."""
        known = self._adapters.get(name)
        if known is not None or not self.enabled:
            return known
        await self.refresh()
        return self._adapters.get(name)

    async def refresh(self) -> None:
        """Adopt the engine's list (the source of truth): names it holds are known here with
        its ids and paths, names it dropped are forgotten."""
        listed = await self._list()
        if listed is None:
            return
        fresh: dict[str, LoRAAdapter] = {}
        for entry in listed:
            name, lora_id = str(entry["name"]), int(entry["lora_id"])
            old = self._adapters.get(name)
            keep = old is not None and old.lora_id == lora_id
            fresh[name] = old if keep and old else LoRAAdapter(name, lora_id, str(entry["path"]))
            self._seen(lora_id)
        self._adapters = fresh

    def forget(self, name: str) -> None:
        """The engine refused ``name`` as not loaded (a sibling unloaded it): drop it here."""
        self._adapters.pop(name, None)

    # ------------------------------------------------------------------ start-up
    async def start(self) -> None:
        """Load (or adopt) every ``--lora-modules`` entry; :class:`StartupError` naming the
        first adapter that cannot be served and why."""
        try:
            await self.refresh()
            self.enabled = True
        except LoRAAdapterError as exc:
            if self.modules:
                raise StartupError(f"--lora-modules: {exc.message}") from None
            return
        for name, path in self.modules:
            if name in self._adapters:
                log.info("LoRA adapter %r: already loaded in the engine, adopted", name)
                continue
            try:
                await self.load(name, path)
            except LoRAAdapterError as exc:
                if name in self._adapters:  # a sibling loaded it meanwhile
                    continue
                raise StartupError(f"--lora-modules {name}={path}: {exc.message}") from None
            log.info("LoRA adapter %r loaded from %s", name, path)

    def engine_restarted(self) -> None:
        """A new engine (cache epoch) holds no adapter: load every known one again, under
        the same ids (the new engine has used none), in the background."""
        if not self._adapters or (self._reload is not None and not self._reload.done()):
            return
        self._reload = asyncio.get_running_loop().create_task(
            self._load_again(self.adapters()), name="mmis-lora-reload"
        )

    async def _load_again(self, adapters: list[LoRAAdapter]) -> None:
        for adapter in adapters:
            try:
                await self._fetch(adapter.name, adapter.path)
                await self._client.call_utility(LOAD, adapter.name, adapter.lora_id, adapter.path)
            except Exception as exc:  # already loaded by a sibling, or gone: the engine decides
                log.warning("LoRA adapter %r not loaded again: %s", adapter.name, exc)
        with contextlib.suppress(Exception):
            await self.refresh()

    async def close(self) -> None:
        if self._reload is not None:
            self._reload.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reload

    # ------------------------------------------------------------------ changes
    async def load(self, name: str, path: str) -> LoRAAdapter:
        """Load ``path`` as ``name`` under a fresh id; :class:`LoRAAdapterError` naming the
        cause when the engine refuses it (nothing is registered then)."""
        async with self._lock:
            held = self._adapters.get(name)
            if held is not None:
                raise LoRANameTakenError(
                    f"the LoRA adapter {name!r} has already been loaded", held_path=held.path
                )
            await self._fetch(name, path)
            for _ in range(_MAX_ID_TRIES):
                lora_id = self._next_id()
                try:
                    await self._client.call_utility(LOAD, name, lora_id, path)
                except UtilityCallError as exc:
                    if exc.code == ErrorCode.LORA_ID_REUSED:  # an earlier P0 of this index
                        continue
                    if exc.code == ErrorCode.LORA_ALREADY_LOADED:  # a sibling loaded it: adopt
                        await self.refresh()
                        held = self._adapters.get(name)
                        raise LoRANameTakenError(
                            _cause(exc, LOAD), held_path=None if held is None else held.path
                        ) from None
                    raise self._refusal(exc, LOAD, "lora_path") from None
                adapter = LoRAAdapter(name, lora_id, path)
                self._adapters[name] = adapter
                return adapter
            raise LoRAAdapterError(f"LoRA adapter {name!r}: no unused id found", param="lora_name")

    async def unload(self, name: str) -> None:
        """Unload ``name``: :class:`LoRANotFoundError` when the engine does not hold it,
        :class:`LoRAInUseError` while a request runs under it."""
        async with self._lock:
            try:
                await self._client.call_utility(UNLOAD, name)
            except UtilityCallError as exc:
                if exc.code == ErrorCode.LORA_NOT_LOADED:
                    self._adapters.pop(name, None)
                    raise LoRANotFoundError(
                        f"the LoRA adapter {name!r} cannot be found", param="lora_name"
                    ) from None
                if exc.code == ErrorCode.LORA_IN_USE:
                    raise LoRAInUseError(_cause(exc, UNLOAD), param="lora_name") from None
                raise self._refusal(exc, UNLOAD, "lora_name") from None
            self._adapters.pop(name, None)

    async def ensure_loaded(self, name: str, path: str) -> bool:
        """The operator's load: ``name`` held from ``path`` afterwards. True when it was
        loaded now, False when the engine already held it from ``path``;
        :class:`LoRAConflictError` when it holds ``name`` from another path."""
        await self.refresh()  # the engine's list: a sibling may have loaded or unloaded it
        try:
            await self.load(name, path)
        except LoRANameTakenError as exc:
            if exc.held_path == path:
                return False
            held = f" from {exc.held_path}" if exc.held_path is not None else ""
            raise LoRAConflictError(
                f"the LoRA adapter {name!r} is already loaded{held}, not from {path}: "
                "unload it first",
                param="lora_path",
            ) from None
        return True

    async def ensure_unloaded(self, name: str) -> bool:
        """The operator's unload: True when ``name`` was unloaded now, False when the engine
        did not hold it; :class:`LoRAInUseError` while a request runs under it."""
        try:
            await self.unload(name)
        except LoRANotFoundError:
            return False
        return True

    # ------------------------------------------------------------------ helpers
    @staticmethod
    async def _fetch(name: str, path: str) -> None:
        """For a hub id, have its files in the HF cache (downloaded on a worker thread) before
        the engine reads them from there; a 400 naming adapter ``name`` and the cause when they
        cannot be had. Nothing for a directory."""
        try:
            source = parse_hub_source(path)
            if source is not None:
                await asyncio.to_thread(download, source)
        except HubSourceError as exc:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {exc}", param="lora_path") from None

    async def _list(self) -> list[dict[str, Any]] | None:
        try:
            listed = await self._client.call_utility(LIST)
        except UtilityCallError as exc:
            raise self._refusal(exc, LIST, None) from None
        return list(listed or [])

    @staticmethod
    def _refusal(exc: UtilityCallError, method: str, param: str | None) -> LoRAAdapterError:
        """The 400 of a refusal: the engine's cause, or that it has no LoRA calls at all."""
        if exc.code == ErrorCode.UNKNOWN_UTILITY:
            return LoRAAdapterError("the engine runs without --enable-lora", param=param)
        return LoRAAdapterError(_cause(exc, method), param=param)

    def _seen(self, lora_id: int) -> None:
        """Move the id sequence past ``lora_id``."""
        while self._index + 1 + self._round * self._stride <= lora_id:
            self._round += 1

    def _next_id(self) -> int:
        for adapter in self._adapters.values():
            self._seen(adapter.lora_id)
        lora_id = self._index + 1 + self._round * self._stride
        self._round += 1
        return lora_id
