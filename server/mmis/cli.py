"""The ``mmis`` command: one entry point, one module per subcommand.

Invariant: ``mmis --help`` imports no subcommand module (so it is fast and works without
torch); a subcommand's module is imported only when that subcommand runs, and one that loads
torch only after the installed torch/torchvision were found inside the supported range
(:mod:`mmis.torch_support`). Each subcommand
module exposes ``add_arguments(parser)`` and ``run(args) -> int``. A
:class:`~mmis.config.StartupError` out of ``run`` (a start that cannot work here) is printed
as one line, ``mmis <command>: <cause and fix>``, with no traceback, and exits 1.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("mmis.entrypoints.serve", "run P1 and P0 together (OpenAI API)"),
    "engine": ("mmis.entrypoints.engine", "run P1, the engine core, alone"),
    "frontend": ("mmis.entrypoints.frontend", "run P0, the OpenAI front end, alone"),
    "encoder": ("mmis.entrypoints.encoder", "run an encoder: vision tower only (E/PD)"),
    "tiny-model": ("mmis.entrypoints.tiny_model", "write a tiny random model to DIR"),
    "wait-frontend": (
        "mmis.entrypoints.wait_frontend",
        "wait until no front end holds --lock (the engine's preStop)",
    ),
    "operator": ("mmis_operator.main", "run the Kubernetes operator (needs mmis-operator)"),
    "bench": ("mmis.entrypoints.bench", "measure an OpenAI-compatible endpoint under load"),
}

# the commands that load torch: refused at once, one line, outside the supported range
# (mmis.torch_support; the range is pyproject.toml's)
NEEDS_TORCH = frozenset({"serve", "engine", "frontend", "encoder", "tiny-model"})


def _available() -> dict[str, tuple[str, str]]:
    found = {}
    for name, (module, text) in COMMANDS.items():
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            spec = None
        if spec is not None:
            found[name] = (module, text)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    commands = _available()
    parser = argparse.ArgumentParser(
        prog="mmis",
        description="mmis: serve multimodal models on Kubernetes.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n"
        + "\n".join(f"  {name:<14} {text}" for name, (_, text) in commands.items()),
    )
    parser.add_argument("--version", action="version", version="mmis 0.1.0")
    parser.add_argument("command", choices=sorted(commands), metavar="COMMAND")
    if not args or args[0].startswith("-"):
        parser.parse_args(args or ["--help"])
        return 0
    name, rest = args[0], args[1:]
    if name not in commands:
        parser.parse_args([name])  # prints the choices and exits 2
    if name in NEEDS_TORCH:
        from mmis.torch_support import UnsupportedTorchError, require_supported

        try:
            require_supported()
        except UnsupportedTorchError as exc:
            print(f"mmis {name}: {exc}", file=sys.stderr)
            return 1
    module = importlib.import_module(commands[name][0])
    sub = argparse.ArgumentParser(prog=f"mmis {name}", description=commands[name][1])
    module.add_arguments(sub)
    from mmis.config import StartupError

    try:
        return int(module.run(sub.parse_args(rest)) or 0)
    except StartupError as exc:  # a known cause: one line with the fix, no traceback
        print(f"mmis {name}: {exc}", file=sys.stderr, flush=True)
        return 1
