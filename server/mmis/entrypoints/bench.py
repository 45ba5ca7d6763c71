"""``mmis bench serve|compare``: the load generator and the comparison of two results.

``mmis bench serve [options]`` is :mod:`mmis.bench.serve` (its options spelled as ``vllm bench
serve`` spells them); ``mmis bench compare A.json B.json`` is :mod:`mmis.bench.compare`.
Invariant: importing this module imports no torch and nothing of the server (an import-linter
contract): the command runs from the plain ``pip install mmis`` against any endpoint.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mmis.bench import serve

    commands = parser.add_subparsers(dest="bench_command", required=True, metavar="SUBCOMMAND")
    serve.add_arguments(
        commands.add_parser(
            "serve",
            help="load an OpenAI-compatible endpoint and measure TTFT, TPOT, ITL, throughput",
            description=(serve.__doc__ or "").split("\n\n")[0],
        )
    )
    compare = commands.add_parser(
        "compare", help="print two saved results side by side with their ratios"
    )
    compare.add_argument("a", type=Path, metavar="A.json")
    compare.add_argument("b", type=Path, metavar="B.json")


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "compare":
        from mmis.bench.compare import print_compare

        return print_compare(args.a, args.b)
    from mmis.bench import serve

    return serve.run(args)
