"""Placeholder for the `mmis operator` entry point (issue: operator, CRD and chart)."""

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    raise SystemExit("mmis operator: not built yet")
