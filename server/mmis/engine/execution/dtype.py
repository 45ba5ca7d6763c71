"""P1's model dtype (``--dtype``), resolved once at start-up, before the model loads.

Invariants:
- ``--dtype auto``: on CUDA the checkpoint's own dtype (``config.json``'s ``dtype`` /
  ``torch_dtype``; float32 when it names none); on CPU bfloat16 only where ``/proc/cpuinfo``
  lists ``amx_bf16`` or ``avx512_bf16`` AND a bfloat16 matmul of a decode-like shape measures
  faster than the float32 one on this machine (:func:`bf16_matmul_faster`, a few ms at
  start-up), else float32. An explicit dtype the device cannot compute in raises
  :class:`DtypeError` naming the flag, before the model is loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from mmis.engine.config import DTYPE_CHOICES
from mmis.engine.execution.timing import best_time

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
CPU_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


class DtypeError(ValueError):
    """A ``--dtype`` the device cannot run."""


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU feature flags of the first ``flags`` line (empty where there is none)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def checkpoint_dtype(path: str | Path) -> torch.dtype:
    """The dtype a local checkpoint's ``config.json`` names (float32 when none)."""
    import json

    config = Path(path) / "config.json"
    name = None
    if config.is_file():
        data = json.loads(config.read_text())
        text = data.get("text_config") or {}
        name = data.get("dtype") or data.get("torch_dtype") or text.get("dtype")
        name = name or text.get("torch_dtype")
    return DTYPES.get(str(name), torch.float32)


def _compute_check(dtype: torch.dtype, device: torch.device) -> None:
    x = torch.ones(4, 4, dtype=dtype, device=device)
    torch.softmax(x @ x, dim=-1).sum().item()


def bf16_matmul_faster(rows: int = 64, width: int = 1024, repeat: int = 5) -> bool:
    """Whether ``[rows, width] @ [width, 4 * width]`` (a batch of decode rows through an MLP)
    is faster in bfloat16 than in float32 on this CPU, best of ``repeat`` after a warm-up."""

    def best(dtype: torch.dtype) -> float:
        a = torch.randn(rows, width, dtype=dtype)
        b = torch.randn(width, 4 * width, dtype=dtype)
        return best_time(lambda: a @ b, repeat)

    return best(torch.bfloat16) < best(torch.float32)


def resolve_dtype(
    name: str,
    device: torch.device,
    model_path: str | Path,
    *,
    flags: Callable[[], frozenset[str]] = cpu_flags,
    bf16_faster: Callable[[], bool] = bf16_matmul_faster,
) -> torch.dtype:
    """The torch dtype ``--dtype name`` means on ``device`` for the checkpoint at
    ``model_path`` (see the module's invariants)."""
    if name == "auto":
        if device.type == "cuda":
            return checkpoint_dtype(model_path)
        return torch.bfloat16 if flags() & CPU_BF16_FLAGS and bf16_faster() else torch.float32
    if name not in DTYPES:
        raise DtypeError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {name!r}")
    dtype = DTYPES[name]
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise DtypeError(
            f"--dtype bfloat16 is not supported on {torch.cuda.get_device_name()} (bfloat16 "
            "needs compute capability 8.0 or newer): use --dtype float16, or --dtype auto"
        )
    try:
        _compute_check(dtype, device)
    except RuntimeError as exc:
        raise DtypeError(f"--dtype {name} is not supported on {device.type}: {exc}") from None
    return dtype


def resolve_placement(
    device: str | None,
    dtype: str,
    model_path: str | Path,
    *,
    revision: str | None,
    what: str,
    logger: logging.Logger,
) -> tuple[torch.device, torch.dtype]:
    """Where and in what a model loads, for P1 and ``mmis encoder`` alike: ``--device`` (else
    CUDA when available) and ``--dtype`` resolved by :func:`resolve_dtype` (its
    :class:`DtypeError` propagates: each process turns it into its own start-up error);
    logged as ``loading <what> <path> (revision R) on DEVICE in DTYPE``."""
    from mmis.engine.execution.model.adapter import default_device

    where = torch.device(device) if device is not None else default_device()
    resolved = resolve_dtype(dtype, where, model_path)
    logger.info(
        "loading %s %s (revision %s) on %s in %s",
        what,
        model_path,
        revision or "default",
        where,
        str(resolved).removeprefix("torch."),
    )
    return where, resolved
