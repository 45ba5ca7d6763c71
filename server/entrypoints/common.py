"""Pieces every ``mmis`` server command shares: model resolution, logging, addresses.

Invariants:
- ``--model`` accepts a local directory, a hub id, or ``mmis-tiny`` / ``mmis-tiny-qwen2-vl``
  (the built-in tiny models, built on first use into the model cache; never committed).
- Engine addresses default to loopback TCP ports that both sides agree on; ``mmis serve``
  picks fresh IPC paths instead.
"""

from __future__ import annotations

import argparse
import logging
import os

TINY_MODELS = {"mmis-tiny": "llava", "mmis-tiny-llava": "llava", "mmis-tiny-qwen2-vl": "qwen2-vl"}
DEFAULT_MODEL = "mmis-tiny"
DEFAULT_INPUT_ADDRESS = "tcp://127.0.0.1:5570"
DEFAULT_OUTPUT_ADDRESS = "tcp://127.0.0.1:5571"


def resolve_model(model: str) -> str:
    """A path (or hub id) that ``from_pretrained`` loads; builds a tiny model when asked."""
    family = TINY_MODELS.get(model)
    if family is None:
        return model
    from mmis.server.engine.tiny_model import tiny_model_dir

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
