"""Python opcodes and C calls executed per decode step of ``bench_host_step.py``: a host-step
A/B that this shared 2-core machine's load does not move.

    PYTHONPATH=<tree>/server .venv/bin/python benchmarks/host_step_opcodes.py [--size 32x1024]
        [--skip 20] [--steps 50] [--top 25]

It runs ``bench_host_step.py`` unchanged (``--sizes SIZE``) and, for ``--steps`` decode steps
(``EngineCore.step`` calls with every request past its prompt) after the first ``--skip``, counts
every opcode the interpreter executes (``sys.settrace`` with ``f_trace_opcodes``) by function,
every call into C (``sys.setprofile``'s ``c_call``) by callee, and every Python call (a frame
made: ``call``) by function. Counts are exact and the same
on every run of a tree; they are a proxy for host time, not a time (an opcode costs a few to
tens of nanoseconds, a C call from tens of nanoseconds to microseconds), so a timing A/B
(``bench_host_step.py`` on a quiet machine, ``benchmarks/README.md``) still decides. Run it
with an older tree's ``server/`` first on ``PYTHONPATH`` to compare two trees function by
function. The benchmark's own lines come first, their times inflated by the tracing (ignore
them). The last line is ``SUMMARY host_step_opcodes: SIZE N opcodes, M C calls, K Python calls a
step``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import runpy
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from mmis.engine.core import EngineCore

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="32x1024", help="one BxC size of bench_host_step.py")
    parser.add_argument("--skip", type=int, default=20, help="decode steps run before counting")
    parser.add_argument("--steps", type=int, default=50, help="decode steps counted")
    parser.add_argument("--top", type=int, default=25, help="functions and C callees listed")
    args = parser.parse_args()

    opcodes: collections.Counter[tuple[str, str]] = collections.Counter()
    c_calls: collections.Counter[str] = collections.Counter()
    py_calls: collections.Counter[tuple[str, str]] = collections.Counter()

    def trace(frame: FrameType, event: str, arg: Any) -> Callable[..., Any]:
        if event == "call":
            frame.f_trace_opcodes = True
        elif event == "opcode":
            code = frame.f_code
            opcodes[os.path.basename(code.co_filename), code.co_name] += 1
        return trace

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call":
            c_calls[getattr(arg, "__qualname__", repr(arg))] += 1
        elif event == "call":  # a Python frame (each costs more than a few opcodes)
            code = frame.f_code
            py_calls[os.path.basename(code.co_filename), code.co_name] += 1

    original = EngineCore.step
    calls = [0]

    def step(self: EngineCore) -> Any:
        scheduler = self.scheduler
        decoding = not scheduler.waiting and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running
        )
        if decoding:  # every row a decode row: the steps bench_host_step.py times
            calls[0] += 1
        if not decoding or not args.skip < calls[0] <= args.skip + args.steps:
            return original(self)
        sys.setprofile(profile)
        sys.settrace(trace)
        try:
            return original(self)
        finally:
            sys.settrace(None)
            sys.setprofile(None)

    EngineCore.step = step  # type: ignore[method-assign]
    total_steps = args.skip + args.steps + 10
    sys.path.insert(0, HERE)
    sys.argv = [
        "bench_host_step.py",
        *("--sizes", args.size, "--steps", str(total_steps), "--warmup", "10"),
    ]
    with contextlib.suppress(SystemExit):
        runpy.run_path(os.path.join(HERE, "bench_host_step.py"), run_name="__main__")
    counted = min(max(calls[0] - args.skip, 0), args.steps)
    if not counted:
        raise SystemExit(f"only {calls[0]} decode steps ran: lower --skip")
    print(f"\nper step, over {counted} steps of {args.size}:")
    for (file, name), count in opcodes.most_common(args.top):
        print(f"  {count / counted:10.1f} opcodes  {file}:{name}")
    for name, count in c_calls.most_common(args.top):
        print(f"  {count / counted:10.1f} C calls  {name}")
    for (file, name), count in py_calls.most_common(args.top):
        print(f"  {count / counted:10.1f} Python calls  {file}:{name}")
    ops, cs = sum(opcodes.values()) / counted, sum(c_calls.values()) / counted
    py = sum(py_calls.values()) / counted
    print(
        f"SUMMARY host_step_opcodes: {args.size} {ops:.0f} opcodes, {cs:.0f} C calls, "
        f"{py:.0f} Python calls a step"
    )


if __name__ == "__main__":
    main()
