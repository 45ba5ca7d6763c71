"""Pieces every ``mmis`` server command shares: model resolution, logging, addresses.

Invariants:
- ``--model`` accepts a local directory, a hub id, or ``mmis-tiny`` / ``mmis-tiny-qwen2-vl``
  (the built-in tiny models, built on first use into the model cache; never committed).
- ``--revision`` (a branch, tag or commit of a hub model) goes to every ``from_pretrained``
  of config, model, processor and tokenizer; for a local directory transformers ignores it.
- ``--processor-kwargs`` is a JSON object, checked while parsing: bad JSON or a non-object is
  a usage error (exit status 2) naming the flag, before anything starts.
- Engine addresses default to loopback TCP ports that both sides agree on; ``mmis serve``
  picks fresh IPC paths instead.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from mmis.config import json_object

TINY_MODELS = {"mmis-tiny": "llava", "mmis-tiny-llava": "llava", "mmis-tiny-qwen2-vl": "qwen2-vl"}
DEFAULT_MODEL = "mmis-tiny"
DEFAULT_INPUT_ADDRESS = "tcp://127.0.0.1:5570"
DEFAULT_OUTPUT_ADDRESS = "tcp://127.0.0.1:5571"
REVISION_HELP = (
    "model revision (branch, tag or commit) for every from_pretrained; "
    "ignored for a local directory"
)
PROCESSOR_KWARGS_HELP = (
    "JSON object of keyword arguments for the model's processor call, "
    """e.g. '{"do_normalize": false}'; part of every image's mm_hash"""
)


def json_object_arg(raw: str) -> dict[str, Any]:
    """argparse ``type=`` of a JSON-object flag: a bad value is a usage error (exit 2)."""
    try:
        return json_object(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def resolve_model(model: str) -> str:
    """A path (or hub id) that ``from_pretrained`` loads; builds a tiny model when asked."""
    family = TINY_MODELS.get(model)
    if family is None:
        return model
    from mmis.engine.tiny_model import tiny_model_dir

    return str(tiny_model_dir(family))


def served_name(model: str, explicit: str | None) -> str:
    if explicit:
        return explicit
    if model in TINY_MODELS:
        return "mmis-tiny" if TINY_MODELS[model] == "llava" else model
    return os.path.basename(os.path.normpath(model)) or model


def add_engine_addresses(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine-input-address",
        "--input-address",
        dest="input_address",
        default=os.environ.get("MMIS_ENGINE_INPUT_ADDRESS", DEFAULT_INPUT_ADDRESS),
        help="ZMQ address of the engine's request socket (P0 connects, P1 binds)",
    )
    parser.add_argument(
        "--engine-output-address",
        "--output-address",
        dest="output_address",
        default=os.environ.get("MMIS_ENGINE_OUTPUT_ADDRESS", DEFAULT_OUTPUT_ADDRESS),
        help="ZMQ address of the engine's output socket (P1 binds, P0 subscribes)",
    )


def setup_logging(level: str | None = None) -> None:
    logging.basicConfig(
        level=(level or os.environ.get("MMIS_LOG_LEVEL", "INFO")).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
