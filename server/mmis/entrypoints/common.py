"""Pieces every ``mmis`` server command shares: model resolution and logging.

Invariants:
- ``--model`` accepts a local directory, a hub id, or ``mmis-tiny`` / ``mmis-tiny-<family>``
  (the built-in tiny models, built on first use into the model cache; never committed).
- ``--revision`` (a branch, tag or commit of a hub model) goes to every ``from_pretrained``
  of config, model, processor and tokenizer; for a local directory transformers ignores it.
- Settings are the fields of ``EngineConfig`` / ``FrontendConfig``; the parsers are derived
  from them (``mmis.config.add_flags``), so no command restates a default.
- One logging set-up (:func:`setup_logging`) for every server command, and one way to say
  why a start failed (:func:`one_line`: the last line a user reads).
"""

from __future__ import annotations

import logging
import os

# the built-in names, one per family of mmis/tiny_models/tiny_model.py (a test keeps them in step;
# importing that module here would load torch into every command)
TINY_MODELS = {
    "mmis-tiny": "llava",
    "mmis-tiny-llava": "llava",
    "mmis-tiny-llava-siglip": "llava-siglip",
    "mmis-tiny-qwen2-vl": "qwen2-vl",
    "mmis-tiny-qwen2.5-vl": "qwen2.5-vl",
    "mmis-tiny-qwen2-vl-hub": "qwen2-vl-hub",
    "mmis-tiny-llava-next": "llava-next",
    "mmis-tiny-llava-onevision": "llava-onevision",
    "mmis-tiny-gemma3": "gemma3",
}


def resolve_model(model: str) -> str:
    """A path (or hub id) that ``from_pretrained`` loads; builds a tiny model when asked."""
    family = TINY_MODELS.get(model)
    if family is None:
        return model
    from mmis.tiny_models.tiny_model import tiny_model_dir

    return str(tiny_model_dir(family))


def served_name(model: str, explicit: str | None) -> str:
    if explicit:
        return explicit
    if model in TINY_MODELS:
        return "mmis-tiny" if TINY_MODELS[model] == "llava" else model
    return os.path.basename(os.path.normpath(model)) or model


def setup_logging(level: str) -> None:
    """The server's logging: ``level`` (a settings field) on stderr, one line per record."""
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (whitespace collapsed, at most 500 characters)."""
    text = " ".join(str(exc).split())
    line = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return line if len(line) <= 500 else line[:497] + "..."
