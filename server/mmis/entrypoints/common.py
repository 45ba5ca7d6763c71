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
- :func:`check_model` runs before anything loads or binds: a ``--model`` that is neither a
  built-in name, a model directory (with ``config.json``) nor a hub id that answers raises
  :class:`~mmis.config.StartupError` in one line, saying which: a path that does not
  exist, a hub id not found (or gated, or a revision not found), or a hub that could not be
  reached (one HEAD request, no retries, ``timeout_s``); with ``HF_HUB_OFFLINE`` set only
  the local cache is read.
"""

from __future__ import annotations

import logging
import os
import re
from urllib.parse import urlparse

from mmis.config import StartupError

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


# a hub id: ``name`` or ``namespace/name`` (what the Hub accepts); anything else is a path
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
HUB_TIMEOUT_S = 10.0  # the one HEAD request that tells "not found" from "not reachable"


def check_model(model: str, revision: str | None = None, timeout_s: float = HUB_TIMEOUT_S) -> None:
    """Return if ``model`` can be loaded from here (module invariants), else raise
    :class:`StartupError` naming the cause and the fix."""
    if model in TINY_MODELS:
        return
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise StartupError(
                f"model directory {model} has no config.json: pass the directory of a Hugging "
                "Face model (config.json, weights, tokenizer), a hub id, or mmis-tiny"
            )
        return
    if os.path.exists(path):
        raise StartupError(f"--model {model} is a file: pass the model's directory")
    if not _HUB_ID.fullmatch(model):
        raise StartupError(
            f"model path {model} does not exist: pass a model directory, a hub id "
            "(namespace/name), or mmis-tiny"
        )
    _check_hub(model, revision, timeout_s)


def _check_hub(model: str, revision: str | None, timeout_s: float) -> None:
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at --revision {revision}" if revision else ""
    cached = isinstance(try_to_load_from_cache(model, "config.json", revision=revision), str)
    if constants.HF_HUB_OFFLINE:
        if cached:
            return
        raise StartupError(
            f"hub model {model}{at} is not in the local cache and HF_HUB_OFFLINE is set: "
            f"download it first (hf download {model}), unset HF_HUB_OFFLINE, or pass a local path"
        )
    host = urlparse(constants.ENDPOINT).netloc or constants.ENDPOINT
    try:
        get_hf_file_metadata(hf_hub_url(model, "config.json", revision=revision), timeout=timeout_s)
    except GatedRepoError:
        raise StartupError(
            f"hub model {model} is gated: accept its terms on {host} and set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise StartupError(
            f"hub model {model} not found on {host} (or private: set HF_TOKEN): check the id, "
            "or pass a local path"
        ) from None
    except RevisionNotFoundError:
        raise StartupError(
            f"--revision {revision} of hub model {model} not found on {host}: check the branch, "
            "tag or commit"
        ) from None
    except HfHubHTTPError as exc:
        if cached:
            return
        raise StartupError(f"hub model {model}{at}: {host} answered {one_line(exc)}") from None
    except Exception as exc:  # the transport's own errors (DNS, refused, timeout)
        if cached:  # transformers falls back to the cache
            logging.getLogger("mmis").warning(
                "could not reach %s; using the cached %s", host, model
            )
            return
        raise StartupError(
            f"could not reach {host} for hub model {model} ({one_line(exc)}): pass a local "
            "path, or set HF_HUB_OFFLINE=1 with the model in the local cache"
        ) from None


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
