"""Kernels per decoder layer in one decode step, unfused vs fused layers (issue 44, build item 4).

    .venv/bin/python benchmarks/kernel_count.py [--families llava qwen2-vl gemma3 ...]
        [--dtypes bfloat16 float32] [--batch 4] [--context 40] [--attention-backend flex]

For each tiny model family (``mmis.tiny_models``) and dtype, the adapter is loaded twice in this
one process, ``fuse=False`` (transformers' layers as they are), and fused as a CUDA load fuses
it (q/k/v and gate/up merged, RMSNorm as torch's ``rms_norm``, Gemma's norms compiled, q and
k's rotary embeddings as one: ``engine/execution/model/fused.py``,
``fuse_adapter(adapter, norms=True, compiled=True)``; a CPU load
keeps transformers' layers). Each runs, through the real :class:`ModelRunner` on CPU with the
attention backend ``--attention-backend`` (default ``flex``, what ``auto`` picks on CUDA: the
paged FlexAttention backend, compiled), a prefill of ``--batch`` text requests of
``--context`` tokens and one warm-up decode step, then one decode step of ``--batch`` rows under
``torch.profiler`` (CPU activities). Forward hooks wrap every decoder layer in a
``mmis::layer`` range and the registered paged attention function in a ``mmis::attention``
range, so each aten event is attributed to its layer, and within it to the attention backend
or to the rest of the layer.

Per layer and per step: the first layer of a step (and Gemma 3's first global layer) also
builds what every later layer shares: the FlexAttention backend's block masks and tables
(``flex_backend._once``) and the joint rotary's signed ``sin`` (``JointRotary.signed``). Those
calls run in a :data:`SETUP` range: the figure per layer is the largest layer's count without
them, and their sum is reported as once per step.

What counts as a kernel (per event, walking down from the layer's range):
- a view or metadata op (:data:`NO_WORK`: views, slices, reshapes that alias, allocations,
  ``result_type``) counts 0 and its children are not visited;
- an op with a CUDA or CPU backend kernel registered in the dispatcher counts 1 and its
  children are not visited (it is one launch on that device: ``aten::mean`` is one reduction
  on CUDA though CPU runs it as ``sum`` + ``div_``; ``aten::_fused_rms_norm`` is one CUDA
  kernel though CPU decomposes it);
- a kernel of a compiled graph (torch.compile's C++ kernels, each profiled as a
  ``graph_N_<kernel>`` range with ``torch._inductor.config.cpp.enable_kernel_profile``; a
  CUDA build of the same graph launches one Triton kernel for each) counts 1;
- a composite op (``linear``, ``to``, ``reshape``, ``contiguous``, ``_to_copy``, ``copy_``...)
  counts what its children count; a composite op without children counts 0 when it is one
  that may return its input (:data:`MAYBE_NOOP`: ``to`` to the same dtype, ``contiguous`` of a
  contiguous tensor), else 1 (``copy_``: the copy kernel).
So the figure is "kernels a CUDA device would launch for this layer", read from a CPU run. The
raw figure beside it counts every CPU leaf op except :data:`NO_WORK` (what this CPU ran).
The last line is ``SUMMARY kernel_count: ...`` with the per-layer figures before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._inductor.config as inductor_config
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile
from transformers import AttentionInterface

from mmis.engine.execution import flex_backend, paged_attention
from mmis.engine.execution.model import load_adapter
from mmis.engine.execution.model.fused import fuse_adapter
from mmis.engine.execution.model.rotary import JointRotary
from mmis.engine.execution.runner import ModelRunner
from mmis.engine.scheduling.sched_output import ScheduledRequest, SchedulerOutput
from mmis.tiny_models.tiny_model import FAMILIES, tiny_model_dir

LAYER = "mmis::layer"
ATTENTION = "mmis::attention"
SETUP = "mmis::step-setup"
BLOCK_SIZE = 16
TARGET = 20
COMPILED_KERNEL = re.compile(r"graph_\d+_\w+$")  # a compiled graph's C++ kernel, profiled

# ops that move no data: views, slices, aliasing reshapes, allocations, metadata
NO_WORK = frozenset(
    "aten::" + n
    for n in """view as_strided alias detach detach_ t transpose permute expand expand_as slice
    select narrow unsqueeze squeeze split split_with_sizes chunk unbind unflatten view_as
    _reshape_alias lift_fresh result_type empty empty_like empty_strided resize_ set_ diagonal
    movedim swapaxes conj resolve_conj resolve_neg _unsafe_view unfold is_nonzero size stride dim
    _has_compatible_shallow_copy_type""".split()  # noqa: SIM905
)
# composite ops that return their input when there is nothing to do (no children then)
MAYBE_NOOP = frozenset(
    "aten::" + n
    for n in "to type_as contiguous reshape flatten float half bfloat16".split()  # noqa: SIM905
)


@functools.cache
def _backend_kernel(name: str) -> bool:
    """Whether the op ``ns::name`` has a CUDA or CPU kernel (any overload) in the dispatcher."""
    if "::" not in name:
        return False
    ns, op = name.split("::", 1)
    try:
        packet = getattr(getattr(torch.ops, ns), op)
        overloads = packet.overloads()
    except (AttributeError, RuntimeError):
        return False
    for overload in overloads:
        full = name if overload == "default" else f"{name}.{overload}"
        for key in ("CUDA", "CPU"):
            try:
                if torch._C._dispatch_has_kernel_for_dispatch_key(full, key):
                    return True
            except RuntimeError:  # a TorchScript-only overload
                continue
    return False


def kernels(event: Any, setup: bool = True) -> int:
    """Kernels a CUDA device would launch for ``event`` (the module docstring's rule); not
    ``setup``: without the :data:`SETUP` ranges under it."""
    name = event.name
    if name in NO_WORK or (name == SETUP and not setup):
        return 0
    if COMPILED_KERNEL.match(name):
        return 1
    children = event.cpu_children
    if name.startswith(("aten::", "mkldnn::")) and _backend_kernel(name):
        return 1
    if children:
        return sum(kernels(c, setup) for c in children)
    if not name.startswith(("aten::", "mkldnn::")):
        return 0  # an empty user range
    return 0 if name in MAYBE_NOOP else 1


def leaves(event: Any) -> int:
    """CPU leaf ops under ``event`` but :data:`NO_WORK` and :data:`SETUP` (what this CPU ran)."""
    if event.name in NO_WORK or event.name == SETUP:
        return 0
    if not event.cpu_children:
        return 1 if event.name.startswith(("aten::", "mkldnn::")) else 0
    return sum(leaves(c) for c in event.cpu_children)


def names(event: Any) -> Iterator[str]:
    """The counted kernels' op names under ``event`` but its :data:`SETUP` (the breakdown)."""
    name = event.name
    if name in NO_WORK or name == SETUP:
        return
    if COMPILED_KERNEL.match(name):
        yield "compiled kernel"
        return
    if name.startswith(("aten::", "mkldnn::")) and _backend_kernel(name):
        yield name
        return
    if event.cpu_children:
        for c in event.cpu_children:
            yield from names(c)
    elif name.startswith(("aten::", "mkldnn::")) and name not in MAYBE_NOOP:
        yield name


@contextlib.contextmanager
def labelled(adapter: Any) -> Iterator[None]:
    """Wrap each decoder layer in a :data:`LAYER` range and the paged attention function in an
    :data:`ATTENTION` range, for the profile."""
    ranges: list[Any] = []
    handles = []

    def enter(*_: Any) -> None:
        ranges.append(record_function(LAYER))
        ranges[-1].__enter__()

    def leave(*_: Any) -> None:
        ranges.pop().__exit__(None, None, None)

    for layer in adapter.language_model.layers:
        handles.append(layer.register_forward_pre_hook(enter))
        handles.append(layer.register_forward_hook(leave))
    original = paged_attention.paged_attention_forward

    def attention(*args: Any, **kwargs: Any) -> Any:
        with record_function(ATTENTION):
            return original(*args, **kwargs)

    once, signed = flex_backend._once, JointRotary.signed

    def setup_once(meta: Any, key: object, build: Callable[[], Any]) -> Any:
        def ranged() -> Any:
            with record_function(SETUP):
                return build()

        return once(meta, key, ranged)

    def setup_signed(self: JointRotary, sin: torch.Tensor) -> torch.Tensor:
        with record_function(SETUP):
            return signed(self, sin)

    AttentionInterface.register(paged_attention.ATTENTION_NAME, attention)
    flex_backend._once = setup_once  # type: ignore[assignment]
    JointRotary.signed = setup_signed  # type: ignore[method-assign]
    try:
        yield
    finally:
        AttentionInterface.register(paged_attention.ATTENTION_NAME, original)
        flex_backend._once = once  # type: ignore[assignment]
        JointRotary.signed = signed  # type: ignore[method-assign]
        for h in handles:
            h.remove()


def prefilled(
    family: str,
    dtype: torch.dtype,
    fuse: bool,
    batch: int,
    context: int,
    steps: int = 4,
    *,
    norms: bool = True,
    backend: str = "flex",
) -> tuple[Any, Callable[[int], None]]:
    """An adapter and a ``decode(position)`` of ``batch`` rows through a real runner on
    attention ``backend``, after a prefill of ``context`` tokens per row (room for ``steps``
    decode steps); ``fuse``: fused as a CUDA load fuses (``norms``) or as a CPU load fuses
    when asked to (not ``norms``: projections and rotary only)."""
    adapter = load_adapter(tiny_model_dir(family), "cpu", dtype, fuse=False)
    if fuse:
        fuse_adapter(adapter, projections=True, norms=norms, compiled=norms)
    per_request = -(-(context + steps) // BLOCK_SIZE)
    runner = ModelRunner.create(
        adapter,
        block_size=BLOCK_SIZE,
        num_blocks=batch * per_request + 1,
        attention_backend=backend,
    )
    tables = [list(range(k * per_request, (k + 1) * per_request)) for k in range(batch)]
    vocab = adapter.vocab_size
    prompts = [[(7 * k + i) % (vocab - 10) + 5 for i in range(context)] for k in range(batch)]
    runner.execute(
        SchedulerOutput(
            [ScheduledRequest(f"r{k}", prompts[k], 0, tables[k], is_new=True) for k in range(batch)]
        )
    )

    def decode(position: int) -> None:
        runner.execute(
            SchedulerOutput(
                [ScheduledRequest(f"r{k}", [11 + k], position, tables[k]) for k in range(batch)]
            )
        )

    return adapter, decode


def decode_step_events(
    family: str, dtype: torch.dtype, fuse: bool, batch: int, context: int, backend: str = "flex"
):
    """The profile's events of one decode step of ``batch`` rows at ``context`` tokens."""
    adapter, decode = prefilled(family, dtype, fuse, batch, context, backend=backend)
    decode(context)  # warm-up
    with labelled(adapter), profile(activities=[ProfilerActivity.CPU]) as prof:
        decode(context + 1)
    return adapter.num_layers, prof.events()


def step_times(
    family: str, dtype: torch.dtype, batch: int, context: int, steps: int, backend: str
) -> tuple[float, float]:
    """Median wall ms of a decode step, unfused and fused as a CPU load would fuse when asked
    (projections and rotary), the two runners alternating step by step (so load on a shared
    machine falls on both alike)."""
    plain = prefilled(family, dtype, False, batch, context, steps + 2, backend=backend)[1]
    fused = prefilled(family, dtype, True, batch, context, steps + 2, norms=False, backend=backend)[
        1
    ]
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(steps + 2):
        for decode, out in ((plain, times[0]), (fused, times[1])):
            start = time.perf_counter()
            decode(context + i)
            if i >= 2:  # two warm-up steps
                out.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[0]), statistics.median(times[1])


def measure(
    family: str, dtype: torch.dtype, fuse: bool, batch: int, context: int, backend: str
) -> dict[str, Any]:
    num_layers, events = decode_step_events(family, dtype, fuse, batch, context, backend)
    layers = [e for e in events if e.name == LAYER]
    if len(layers) != num_layers:
        raise RuntimeError(f"{len(layers)} layer ranges for {num_layers} layers")
    total = [kernels(e, setup=False) for e in layers]
    attention = [
        sum(kernels(e, setup=False) for e in events if e.name == ATTENTION and _inside(e, layer))
        for layer in layers
    ]
    per_layer = max(total)
    ops: dict[str, int] = {}
    for name in names(layers[total.index(per_layer)]):
        ops[name] = ops.get(name, 0) + 1
    return {
        "per_layer": per_layer,
        "per_step": sum(kernels(e) for e in events if e.name == SETUP),
        "attention": max(attention),
        "raw_cpu": max(leaves(e) for e in layers),
        "ops": ops,
    }


def _inside(event: Any, ancestor: Any) -> bool:
    while event is not None:
        if event is ancestor:
            return True
        event = event.cpu_parent
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=40)
    parser.add_argument(
        "--attention-backend",
        default="flex",
        choices=["flex", "torch"],
        help="flex: the paged FlexAttention backend CUDA runs; torch: the CPU gather backend",
    )
    parser.add_argument("--ops", action="store_true", help="print the counted ops of layer 0")
    parser.add_argument(
        "--time-steps", type=int, default=0, help="also time this many decode steps each way"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    inductor_config.cpp.enable_kernel_profile = True  # a compiled graph's kernels, by name
    backend = args.attention_backend
    summary = []
    print(
        f"torch {torch.__version__}; decode step of {args.batch} rows at {args.context} tokens; "
        f"attention backend {backend}"
    )
    print(
        f"{'family':16} {'dtype':9} {'before':>7} {'after':>6} {'attn':>5} {'step':>5} "
        f"{'raw CPU':>12}"
    )
    for family in args.families:
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            before = measure(family, dtype, False, args.batch, args.context, backend)
            after = measure(family, dtype, True, args.batch, args.context, backend)
            print(
                f"{family:16} {dtype_name:9} {before['per_layer']:7d} {after['per_layer']:6d} "
                f"{after['attention']:5d} {after['per_step']:5d} "
                f"{before['raw_cpu']:5d} -> {after['raw_cpu']:3d}"
            )
            if args.time_steps:
                ms = step_times(family, dtype, args.batch, args.context, args.time_steps, backend)
                print(f"    CPU decode step median: {ms[0]:.2f} ms unfused, {ms[1]:.2f} ms fused")
            if args.ops:
                for label, m in (("before", before), ("after", after)):
                    shown = ", ".join(
                        f"{n.removeprefix('aten::')} {c}" for n, c in m["ops"].items()
                    )
                    print(f"    {label}: {shown}")
            summary.append(
                f"{family}/{dtype_name} {before['per_layer']}->{after['per_layer']} "
                f"(attention {after['attention']}; once per step {after['per_step']})"
            )
    print(
        f"SUMMARY kernel_count ({backend}): per decoder layer, before->after: "
        f"{'; '.join(summary)}; target <= {TARGET}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
