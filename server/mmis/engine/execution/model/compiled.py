"""Small pure functions of the decoder layers, compiled into one kernel each (issue 44).

What a layer does between its matmuls and its attention is a chain of elementwise ops and a
row reduction. In eager torch each op is its own kernel launch and its own pass over memory:
Gemma's RMSNorm in bfloat16 is an up-cast, ``rms_norm`` and a down-cast (``rms_norm`` does
not take a bfloat16 input with its float32 weight), three kernels where one would do. The
functions here state that arithmetic once; :func:`call` runs them through
``torch.compile`` (inductor: one Triton kernel on CUDA, one C++ kernel on CPU, the same
float32 arithmetic as the eager function up to the order of a row's sum), with dynamic shapes
(one graph for every batch and length; a few more for the input layouts a layer passes), so
``model/norms.py``'s modules take them where their load asks for it (``fuse_adapter``: on
CUDA).

Invariants:
- Each function is the eager arithmetic of the module it stands for; compiled, its result is
  the eager one within a few float32 ulps before the final rounding
  (tests/engine/test_compiled_norms.py).
- A function that fails to compile or run compiled (a missing compiler, an unsupported
  layout) runs eager from then on, for the whole process, logged once (:data:`BROKEN`):
  the answer is the same, only with more launches. An out-of-memory error is raised as it is.
- A compiled call runs no host read (``item()``) around its kernel: its float arguments are
  constants of the graph (``specialize_float``, set for the process, like the recompile
  limit).
- Compilation happens on the first call of each graph: the norms' load probe
  (``model/norms.py``) makes the first one at load, the decode graphs' warm-up
  (``engine/execution/decode_graphs.py``) runs every bucket before capture, so no graph is
  compiled inside a capture. Inductor caches what it built on disk (its FX graph cache, on
  by default), so a restarted engine on the same node loads them instead of compiling.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

RECOMPILE_LIMIT = 16  # graphs one function may compile (dtypes x layouts; shapes are dynamic)
BROKEN: dict[str, str] = {}  # function name -> why it runs eager
_COMPILED: dict[Callable[..., Any], Callable[..., Any]] = {}


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: normalised in float32, times the float32 ``(1 + w)`` (``weight``),
    rounded once to ``x``'s dtype (transformers' ``Gemma3RMSNorm``)."""
    out = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), weight, eps)
    return out.to(x.dtype)


def joint_qk_norm(
    rows: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """Gemma's q_norm and k_norm on ``rows`` (``[B, S, Hq + Hk, D]``), each head by its own
    float32 ``(1 + w)`` (``weight``, ``[Hq + Hk, D]``), rounded once to ``dtype``."""
    normed = torch.nn.functional.rms_norm(rows.float(), (rows.shape[-1],), None, eps)
    return (normed * weight).to(dtype)


def call(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """``fn(*args)`` through its compiled graph, or eager once that failed (see the module
    docstring)."""
    if fn.__name__ in BROKEN:
        return fn(*args)
    compiled = _COMPILED.get(fn)
    if compiled is None:
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
        # a float argument (eps) a constant of its graph: torch 2.11 otherwise passes it in as
        # a 0-d tensor and reads it back with an ``item()`` on every call
        dynamo.specialize_float = True
        compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        _COMPILED[fn] = compiled
    try:
        result: torch.Tensor = compiled(*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # a compiler or a layout inductor does not take: eager from now
        BROKEN[fn.__name__] = f"{type(exc).__name__}: {str(exc)[:300]}"
        log.warning("compiled %s failed (%s); it runs eager", fn.__name__, BROKEN[fn.__name__])
        return fn(*args)
    return result
