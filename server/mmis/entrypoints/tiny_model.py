"""``mmis tiny-model DIR [--family F] [--seed N]``: write a tiny random model of a family.

Families (``mmis/tiny_models/tiny_model.py``): ``llava`` (CLIP tower), ``llava-siglip`` (SigLIP
tower, no CLS token), ``qwen2-vl``, ``qwen2.5-vl``, and ``qwen2-vl-hub`` (Qwen2-VL with the
hub checkpoints' image settings and context, for real photos).

Invariant: the directory loads with plain ``AutoProcessor`` and
``AutoModelForImageTextToText.from_pretrained(DIR)``; an existing non-empty DIR is refused
(exit status 2) rather than overwritten.
"""

from __future__ import annotations

import argparse
import sys

from mmis.tiny_models.tiny_model import DEFAULT_FAMILY, MODELS, TinyModelError, build_tiny_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", metavar="DIR", help="where to write the model (new or empty)")
    parser.add_argument("--family", choices=MODELS, default=DEFAULT_FAMILY, help="model family")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")


def run(args: argparse.Namespace) -> int:
    try:
        path = build_tiny_model(args.directory, args.family, seed=args.seed)
    except TinyModelError as exc:
        print(f"mmis tiny-model: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0
