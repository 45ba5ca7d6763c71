"""Loading the encoder's model (vision tower + projector only) and sizing its output cache.

Invariants:
- The model loads through P1's adapter table (``engine/execution/model/__init__.py``
  ``load_adapter``) on the device and in the dtype P1 would pick, by P1's own function
  (``engine/execution/dtype.py`` ``resolve_placement``): ``--device`` else CUDA when
  available; ``--dtype`` resolved there (``auto``: the checkpoint's on CUDA; on CPU a
  measurement, so pin ``--dtype`` on both sides: a P1 that resolved another dtype gets the
  encoder's outputs refused by P0's key check, a fallback).
  The language model is not fused (``fuse=False``): its layers are dropped next.
- Then the language model's decoder layers, its token embedding and the LM head are dropped
  (set to an empty ``ModuleList`` / None) and their memory freed (``gc``, and the CUDA
  allocator's cache emptied): only the vision tower, the projector and the language model's
  small leftovers (final norm, rotary tables) stay resident. The adapter's
  ``encode_images`` is all the encoder calls; it reads none of what was dropped.
- Peak memory at start-up is the whole model once (``from_pretrained`` loads every weight
  before anything can be dropped); what stays is the vision tower + projector.
- The output cache holds host copies of the outputs (every reply leaves from host memory, so
  a hit costs no device copy). Its budget is ``--cache-gb`` if given, else
  :data:`HOST_FRACTION` of the host memory available once the model is loaded
  (:func:`host_available_bytes`: ``MemAvailable``, bounded by the cgroup's ``memory.max``
  less its ``memory.current`` inside a container), read once at start-up.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from mmis.config import GiB

if TYPE_CHECKING:
    from mmis.engine.encoder.config import EncoderConfig
    from mmis.engine.execution.model import ModelAdapter

log = logging.getLogger("mmis.encoder")

HOST_FRACTION = 0.5  # of the host memory available after loading, when --cache-gb is unset
MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


class EncoderStartError(RuntimeError):
    """The encoder cannot start with these settings or this model; the message says why."""


def load_vision_only(cfg: EncoderConfig, path: str) -> ModelAdapter:
    """The adapter of ``cfg.model`` (resolved to ``path``) with its language model dropped."""
    from mmis.engine.execution.dtype import DtypeError, resolve_placement
    from mmis.engine.execution.model import UnsupportedModelError, load_adapter

    try:
        device, dtype = resolve_placement(
            cfg.device,
            cfg.dtype,
            path,
            revision=cfg.revision,
            what="the vision tower of",
            logger=log,
        )
    except DtypeError as exc:
        raise EncoderStartError(str(exc)) from None
    try:
        adapter = load_adapter(path, device=device, dtype=dtype, revision=cfg.revision, fuse=False)
    except UnsupportedModelError as exc:
        raise EncoderStartError(f"cannot serve {cfg.model}: {exc}") from None
    before = parameter_bytes(adapter)
    drop_language_model(adapter)
    log.info(
        "language model dropped: %.1f MiB of weights resident of %.1f MiB loaded",
        parameter_bytes(adapter) / 2**20,
        before / 2**20,
    )
    return adapter


def drop_language_model(adapter: ModelAdapter) -> None:
    """Drop the decoder layers, the token embedding and the LM head; free their memory."""
    import torch

    language_model = adapter.language_model
    language_model.layers = torch.nn.ModuleList()
    if getattr(language_model, "embed_tokens", None) is not None:
        language_model.embed_tokens = None
    if getattr(adapter.model, "lm_head", None) is not None:
        adapter.model.lm_head = None
    gc.collect()
    if adapter.device.type == "cuda":
        torch.cuda.empty_cache()


def parameter_bytes(adapter: ModelAdapter) -> int:
    """Bytes of the model's parameters and buffers still resident."""
    tensors = [*adapter.model.parameters(), *adapter.model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def host_available_bytes(meminfo: Path = MEMINFO, cgroup: Path = CGROUP) -> int:
    """Host memory this process may still take: ``MemAvailable``, and inside a cgroup (v2)
    with a memory limit no more than ``memory.max - memory.current``."""
    available = 0
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except OSError:
        available = 0
    limit = _read_int(cgroup / "memory.max")
    current = _read_int(cgroup / "memory.current")
    if limit is not None and current is not None:
        room = max(limit - current, 0)
        available = min(available, room) if available else room
    return available


def cache_budget(cfg: EncoderConfig, available: int | None = None) -> tuple[int, str]:
    """The output cache's bytes and what chose them (for the start-up log line)."""
    if cfg.cache_gb is not None:
        return int(cfg.cache_gb * GiB), "--cache-gb"
    free = host_available_bytes() if available is None else available
    return int(free * HOST_FRACTION), f"{HOST_FRACTION:.0%} of {free / GiB:.1f} GiB available"
