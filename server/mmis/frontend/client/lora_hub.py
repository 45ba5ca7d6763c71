"""A LoRA adapter's ``lora_path`` as a hub id (issue 47): ``hf://<org>/<name>[@<revision>]``.

Invariants:
- :func:`parse_hub_source` is the one reader of the form: ``None`` for a path that does not
  start with ``hf://`` (a directory on the server, as before); a :class:`HubSource` for
  ``hf://org/name`` or ``hf://org/name@revision`` (a branch, tag or commit; the hub's own
  repo-id rules apply to ``org/name``); :class:`HubSourceError` naming the expected form for
  anything else (no org, a third path part, an empty revision, whitespace).
- :func:`download` fetches only the adapter's files (``adapter_config.json``,
  ``adapter_model.*``: :data:`ADAPTER_FILES`) with huggingface_hub's ``snapshot_download``
  into the HF cache (``HF_HOME`` / ``HF_HUB_CACHE``; ``HF_TOKEN`` from the environment opens
  private and gated repos) and returns the snapshot directory, which the engine then reads as
  any adapter directory. A snapshot already in the cache is used without the network when the
  hub cannot be reached or ``HF_HUB_OFFLINE`` is set.
- Every failure is a :class:`HubSourceError` whose message names the adapter's id and the
  cause: not in the cache with ``HF_HUB_OFFLINE`` set, the hub unreachable, no such repo (or
  private without a token), a gated repo, no such revision, the hub's HTTP answer. It fails
  fast: one attempt, no retry loop (huggingface_hub's own call, no backoff on a refused
  connection).
- :func:`download` blocks (network, disk): P0 runs it on a worker thread, never on its event
  loop, and never in the engine's busy loop.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlparse

SCHEME = "hf://"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.*")
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?"
_FORM = re.compile(rf"(?P<repo>{_PART}/{_PART})(?:@(?P<revision>[A-Za-z0-9._/-]+))?")
FORM_HELP = "hf://<org>/<name>[@<revision>]"


class HubSourceError(ValueError):
    """A hub id that is malformed or cannot be fetched; the message names the cause."""


@dataclass(frozen=True, slots=True)
class HubSource:
    """``repo`` (``org/name``) at ``revision`` (None: the repo's default branch)."""

    repo: str
    revision: str | None = None

    def __str__(self) -> str:
        return SCHEME + self.repo + (f"@{self.revision}" if self.revision else "")


def parse_hub_source(path: str) -> HubSource | None:
    """The hub id ``path`` names (see the module's invariants); None when it is no hub id."""
    if not path.startswith(SCHEME):
        return None
    match = _FORM.fullmatch(path[len(SCHEME) :])
    revision = None if match is None else match["revision"]
    bad = match is None or ".." in match["repo"] or "--" in match["repo"]
    bad = bad or (revision is not None and (".." in revision or revision.endswith("/")))
    if bad or match is None:
        raise HubSourceError(f"{path!r} is not of the form {FORM_HELP}")
    return HubSource(match["repo"], revision)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def download(source: HubSource) -> str:
    """The local snapshot directory of ``source``'s adapter files (downloaded if needed);
    :class:`HubSourceError` naming the cause when they cannot be had."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    host = urlparse(constants.ENDPOINT).netloc or constants.ENDPOINT
    try:
        folder: str = snapshot_download(
            source.repo, revision=source.revision, allow_patterns=list(ADAPTER_FILES)
        )
    except GatedRepoError:
        why = f"is gated on {host}: accept its terms and set HF_TOKEN"
    except RevisionNotFoundError:
        why = f"has no revision {source.revision!r} on {host}"
    except RepositoryNotFoundError:
        why = f"was not found on {host} (or is private: set HF_TOKEN)"
    except LocalEntryNotFoundError as exc:
        if constants.HF_HUB_OFFLINE:
            why = "is not in the local HF cache and HF_HUB_OFFLINE is set"
        else:
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            why = f"could not be fetched: {host} unreachable ({_one_line(cause)})"
            why += " and it is not in the local HF cache"
    except HfHubHTTPError as exc:
        why = f"could not be fetched: {host} answered {_one_line(exc)}"
    except Exception as exc:  # the transport's own errors, a full disk, ...
        why = f"could not be fetched: {_one_line(exc)}"
    else:
        return folder
    raise HubSourceError(f"{source} {why}")
