"""A guard around a language-model forward: no host syncs, no data-dependent shapes, and the
bytes copied out of the KV pool.

:class:`ForwardGuard` is entered around exactly the region to check (the tests wrap the
adapter's ``forward``, the one language-model call of a step in ``runner.py``; embedding,
encoder and sampler stay outside). While active it records, with the ``file:line`` of the
innermost non-torch frame:

Forbidden (:attr:`ForwardGuard.violations`), each a device->host sync on CUDA or an output
whose size is known only once the data is read (which forces a sync to allocate it):

- ``aten._local_scalar_dense`` / ``aten.item``: ``t.item()``, ``int(t)``, ``float(t)``,
  ``t.__index__()``: the value is read on the host;
- ``aten.is_nonzero`` (``bool(t)``, ``if t:``), ``aten.equal``: a Python bool from tensor data;
- every op torch tags ``dynamic_output_shape`` (``torch.Tag``): ``aten.nonzero``,
  ``aten.masked_select``, ``aten._unique`` / ``_unique2`` / ``unique_dim`` /
  ``unique_consecutive``, ``aten.bincount`` (size = max value + 1), ``aten.one_hot`` with
  ``num_classes=-1`` (size = max value + 1), ``aten.repeat_interleave.Tensor`` without
  ``output_size`` (size = sum of the repeats), ``aten.index.Tensor`` with a boolean / uint8
  index (size = number of True); with integer indices ``index.Tensor`` has a static shape and
  is allowed, as is ``repeat_interleave`` given ``output_size`` and ``one_hot`` given
  ``num_classes``;
- ``aten.where`` with one argument, ``aten.nonzero_numpy``, ``aten.argwhere``: ``nonzero``;
  ``aten.repeat_interleave.self_Tensor`` without ``output_size`` (the Tensor overload, as
  seen before decomposition under inference mode);
- ``aten.index_put`` / ``index_put_`` / ``_index_put_impl_`` with a boolean index: runs
  ``nonzero`` on the mask (a sync on CUDA) though its output shape is static;
- a copy to the host: ``aten._to_copy`` / ``aten.to`` to the CPU of a non-CPU tensor,
  ``aten.copy_`` into a CPU tensor from a non-CPU one;
- an upload that waits for the stream: a host -> device copy from pageable memory or with
  ``non_blocking=False`` (CUDA stages pageable memory after a stream sync), and
  ``aten.lift_fresh`` (``torch.tensor(...)`` / ``torch.as_tensor(...)`` of host data inside the
  forward: on CUDA such an upload; the step's host inputs arrive in its one upload,
  ``step_builder.HostToDevice``); a 0-dim one is a Python scalar wrapped (torch 2.11 wraps
  the ``-1`` of ``t[:, 0] = -1`` so), which kernels take as an argument: allowed;
- explicit waits: ``torch.cuda.synchronize``, ``torch.cuda.Event.synchronize``,
  ``torch.cuda.Stream.synchronize`` (patched while the guard is entered);
- host reads that the CPU dispatcher never sees (a CPU tensor's ``tolist``/``numpy`` read its
  memory directly), caught one level up by a ``TorchFunctionMode``: ``Tensor.tolist``,
  ``Tensor.numpy``, ``Tensor.__array__`` (``np.asarray(t)``).

``nonzero_static`` and the ``output_size=`` forms are allowed: their shapes come from host
ints.

Bytes copied out of the KV pool (:attr:`ForwardGuard.bytes_out`, by op in
:attr:`ForwardGuard.copies`): an op is a copy out of the pool when one of its tensor inputs
shares storage with a pool tensor (``untyped_storage().data_ptr()`` of ``pool.key_cache`` /
``value_cache``: a view of the pool counts) and it returns a tensor whose storage is not a
pool's, and it moves data rather than computing from it (:data:`COPY_OPS`: index_select,
gather, index, clone, to/_to_copy, copy_, cat, reshape/contiguous that copy, ...): its output
bytes count. A view of the pool (same storage) and a write INTO the pool (``index_copy_``,
``copy_`` whose destination is the pool: the output is the pool) count nothing. An attention
kernel that reads the pool in place (FlexAttention, SDPA over pool views) computes from it:
not a copy; such reads are listed in :attr:`ForwardGuard.reads` for information.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

# overload packets whose every call syncs or reads tensor data on the host
ALWAYS = {
    aten._local_scalar_dense,
    aten.item,
    aten.is_nonzero,
    aten.equal,
    aten.nonzero,
    aten.nonzero_numpy,
    aten.argwhere,
    aten.masked_select,
    aten.bincount,
}
# overload packets that move data: their output is a copy of (part of) an input
COPY_OPS = {
    aten.index_select,
    aten.gather,
    aten.index,
    aten._unsafe_index,
    aten.take,
    aten.take_along_dim,
    aten.clone,
    aten.contiguous,
    aten._to_copy,
    aten.to,
    aten.copy_,
    aten.copy,
    aten.cat,
    aten.stack,
    aten.reshape,
    aten.flatten,
    aten.repeat,
    aten.repeat_interleave,
    aten.expand_copy,
    aten.narrow_copy,
    aten.masked_select,
    aten.embedding,
    aten.index_put,
    aten._unsafe_view,
    aten.view_copy,
    aten.slice_copy,
    aten.select_copy,
    aten.transpose_copy,
    aten.permute_copy,
    aten.as_strided_copy,
    aten.unfold_copy,
}
_MOVES = {aten._to_copy, aten.to, aten.copy_, aten.copy}  # checked for a device -> host copy
_HOST_READS = {"tolist", "numpy", "__array__"}
_HERE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclasses.dataclass(frozen=True)
class Violation:
    op: str
    why: str
    where: str  # file:line of the innermost frame outside torch and this guard

    def __str__(self) -> str:
        return f"{self.op} at {self.where}: {self.why}"


def _where() -> str:
    frames = traceback.extract_stack()
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if path == _HERE or path.startswith(_TORCH_DIR):
            continue
        return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "?"


def _tensors(values: Iterable[Any]) -> Iterator[torch.Tensor]:
    for leaf in tree_leaves(list(values)):
        if isinstance(leaf, torch.Tensor):
            yield leaf


def _has_bool_index(indices: Any) -> bool:
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
        for i in (indices or ())
    )


def forbidden(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why ``func(*args, **kwargs)`` may not run inside the forward (None: it may)."""
    packet = func.overloadpacket
    name = packet.__name__
    if packet in ALWAYS:
        return "reads tensor data on the host / its output size depends on the data"
    if packet in (aten.lift_fresh, aten.lift_fresh_copy):
        if isinstance(args[0], torch.Tensor) and args[0].dim() == 0:
            return None  # a Python scalar wrapped (``t[i] = -1``): a kernel argument, no upload
        return "a tensor from host data (torch.tensor / as_tensor): an upload on CUDA"
    if "unique" in name:
        return "output size = number of distinct values"
    if packet is aten.repeat_interleave and func is not aten.repeat_interleave.self_int:
        output_size = kwargs.get("output_size")
        if output_size is None and func is aten.repeat_interleave.Tensor and len(args) > 1:
            output_size = args[1]
        if output_size is None and func is aten.repeat_interleave.self_Tensor and len(args) > 3:
            output_size = args[3]
        if output_size is None:
            return "repeat_interleave by a tensor without output_size (sums the repeats)"
        return None
    if packet is aten.index:
        if _has_bool_index(args[1] if len(args) > 1 else kwargs.get("indices")):
            return "boolean indexing: output size = number of True"
        return None
    if packet in (aten.index_put, aten.index_put_, aten._index_put_impl_):
        if _has_bool_index(args[1] if len(args) > 1 else kwargs.get("indices")):
            return "index_put with a boolean index runs nonzero on the mask"
        return None
    if packet is aten.one_hot:
        classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
        return "one_hot without num_classes: size = max value + 1" if classes == -1 else None
    if packet is aten.where and len(args) == 1:
        return "where(condition) is nonzero"
    if torch.Tag.dynamic_output_shape in func.tags or torch.Tag.data_dependent_output in func.tags:
        return "torch tags it dynamic_output_shape / data_dependent_output"
    return None


class _Dispatch(TorchDispatchMode):
    supports_higher_order_operators = True

    def __init__(self, guard: ForwardGuard) -> None:
        super().__init__()
        self.guard = guard
        # inside the decomposition of an op already reported: its parts are not reported again
        self.inside_violation = False

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        guard = self.guard
        if isinstance(func, torch._ops.HigherOrderOperator):
            return self._higher_order(func, args, kwargs)
        why = forbidden(func, args, kwargs)
        if why is not None and not self.inside_violation:
            guard.violate(str(func), why)
        if torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), torch._C.DispatchKey.CompositeImplicitAutograd
        ):
            # see the ops it runs (inference mode hands the composite op itself to the mode)
            outer = self.inside_violation
            self.inside_violation = outer or why is not None
            try:
                with self:
                    out = func.decompose(*args, **kwargs)
            finally:
                self.inside_violation = outer
            if out is not NotImplemented:
                return out
        pool = guard.pool_storages
        reads_pool = bool(pool) and any(
            t.untyped_storage().data_ptr() in pool for t in _tensors((args, kwargs))
        )
        out = func(*args, **kwargs)
        if func.overloadpacket in _MOVES:
            guard.check_move(func, args, kwargs, out)
        if reads_pool:
            fresh = [t for t in _tensors([out]) if t.untyped_storage().data_ptr() not in pool]
            nbytes = sum(t.numel() * t.element_size() for t in fresh)
            if nbytes:
                if func.overloadpacket in COPY_OPS:
                    guard.bytes_out += nbytes
                    guard.copies[str(func)] += nbytes
                else:
                    guard.reads[str(func)] += 1
        return out

    def _higher_order(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A higher-order op (``flex_attention``) runs as one kernel, not looked into: its
        compiled form (Triton, C++) has no host sync by construction; reading the pool in
        place is a read, not a copy."""
        pool = self.guard.pool_storages
        out = func(*args, **kwargs)
        if pool and any(t.untyped_storage().data_ptr() in pool for t in _tensors((args, kwargs))):
            self.guard.reads[str(func.name())] += 1
        return out


class _Function(TorchFunctionMode):
    def __init__(self, guard: ForwardGuard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = getattr(func, "__name__", "")
        if name in _HOST_READS:
            self.guard.violate(f"Tensor.{name}", "reads tensor data on the host")
        return func(*args, **(kwargs or {}))


class ForwardGuard:
    """Records :class:`Violation` s and pool bytes while entered (see the module docstring);
    ``pool_tensors`` are the KV pool's tensors (none: no byte count)."""

    def __init__(self, pool_tensors: Iterable[torch.Tensor] = ()) -> None:
        self.pool_storages = {t.untyped_storage().data_ptr() for t in pool_tensors}
        self.violations: list[Violation] = []
        self.bytes_out = 0
        self.copies: Counter[str] = Counter()
        self.reads: Counter[str] = Counter()
        self._modes: list[Any] = []
        self._patched: list[tuple[Any, str, Any]] = []

    @classmethod
    def for_pool(cls, pool: Any) -> ForwardGuard:
        return cls([*pool.key_cache, *pool.value_cache])

    def check_move(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> None:
        """A device -> host copy, or a host -> device one that waits for the stream (from
        pageable memory, or blocking)."""
        sources = list(_tensors((args, kwargs)))
        targets = list(_tensors([out]))
        if func.overloadpacket is aten.copy_:  # copy_(dst, src): the source is args[1]
            sources = [args[1]] if isinstance(args[1], torch.Tensor) else []
        if any(t.device.type != "cpu" for t in sources):
            if any(t.device.type == "cpu" for t in targets):
                self.violate(str(func), "a copy to the host")
        elif any(t.device.type != "cpu" for t in targets):
            pinned = all(t.is_pinned() for t in sources)
            blocking = not kwargs.get("non_blocking", False)
            if func is aten.copy_.default and len(args) > 2:
                blocking = not args[2]
            if func is aten.to.device and len(args) > 3:
                blocking = not args[3]
            if not (pinned and not blocking):
                self.violate(
                    str(func), "an upload from pageable memory or blocking: waits for the stream"
                )

    def violate(self, op: str, why: str) -> None:
        self.violations.append(Violation(op, why, _where()))

    def __enter__(self) -> ForwardGuard:
        self._modes = [_Function(self), _Dispatch(self)]
        for mode in self._modes:
            mode.__enter__()
        _ACTIVE.append(self)
        self._patched = [(owner, name, getattr(owner, name)) for owner, name in _SYNC_CALLS]
        for owner, name, real in self._patched:
            setattr(owner, name, self._recording(f"{owner.__name__}.{name}", real))
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, real in self._patched:
            setattr(owner, name, real)
        self._patched = []
        _ACTIVE.remove(self)
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []

    def _recording(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self in _ACTIVE:
                self.violate(name, "an explicit synchronisation")
            return real(*args, **kwargs)

        return call

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The guard's modes off (they must be the innermost), then back on."""
        modes = self._modes
        for mode in reversed(modes):
            mode.__exit__(None, None, None)
        try:
            yield
        finally:
            for mode in modes:
                mode.__enter__()


_ACTIVE: list[ForwardGuard] = []
# explicit waits, no dispatcher op: patched while a guard is entered
_SYNC_CALLS = (
    (torch.cuda, "synchronize"),
    (torch.cuda.Event, "synchronize"),
    (torch.cuda.Stream, "synchronize"),
)


def opaque(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """``kernel`` run with the active guard paused: for ``torch.compile``'d kernels
    (``flex_attention``), which refuse to run under a user dispatch mode ("non-infra torch
    dispatch mode present"). Compiled with ``fullgraph=True`` they cannot sync on the host
    (a ``.item()`` would be a graph break: an error); their inputs that are pool views are
    counted as reads (in place, not copies)."""

    @functools.wraps(kernel)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not _ACTIVE:
            return kernel(*args, **kwargs)
        guard = _ACTIVE[-1]
        pool = guard.pool_storages
        if any(t.untyped_storage().data_ptr() in pool for t in _tensors((args, kwargs))):
            guard.reads[f"{getattr(kernel, '__name__', kernel)} (opaque)"] += 1
        with guard.paused():
            return kernel(*args, **kwargs)

    return run


def guarded(
    forward: Callable[..., Any], pool: Any, record: list[ForwardGuard]
) -> Callable[..., Any]:
    """``forward`` run under a fresh :class:`ForwardGuard` over ``pool`` per call, each
    appended to ``record``."""

    def run(*args: Any, **kwargs: Any) -> Any:
        guard = ForwardGuard.for_pool(pool)
        record.append(guard)
        with guard:
            return forward(*args, **kwargs)

    return run
