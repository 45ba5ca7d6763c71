"""Which torch (and torchvision) releases this mmis runs on, checked before anything imports them.

The supported range has one source: the ``torch`` / ``torchvision`` requirements in
``pyproject.toml``, read back from the installed distribution's metadata. ``pip install mmis``
into an image that already has a torch inside that range keeps it (README, "Supported torch");
an install that bypassed the resolver (``--no-deps``, a later ``pip install torch==...``) can
still leave an older or newer release, and then the commands that load models refuse to start
with one line naming the range instead of failing later in an obscure kernel call.

Invariants:
- Reads metadata only (``importlib.metadata``): importing this module imports neither torch
  nor anything of mmis, so ``mmis`` can refuse in milliseconds.
- A release is judged by its public version: a local label (``2.11.0+cu130``) is ignored.
- Without the mmis distribution's metadata (a source checkout run without installing) nothing
  is checked.
"""

from __future__ import annotations

import re
from importlib import metadata

from packaging.requirements import Requirement
from packaging.version import Version

CHECKED = ("torch", "torchvision")


class UnsupportedTorchError(RuntimeError):
    """An installed torch or torchvision outside the range this mmis declares."""


def declared(distribution: str = "mmis") -> dict[str, Requirement]:
    """``{name: requirement}`` for the checked packages, from ``distribution``'s metadata."""
    try:
        requires = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:
        return {}
    found: dict[str, Requirement] = {}
    for line in requires:
        req = Requirement(line)
        if req.name in CHECKED and req.marker is None:
            found[req.name] = req
    return found


def spelled(req: Requirement) -> str:
    """``torch>=2.11,<2.15``: the lower bound first, as pyproject.toml writes it."""
    parts = sorted((str(s) for s in req.specifier), key=lambda s: (not s.startswith(">"), s))
    return req.name + ",".join(parts)


def installed_version(name: str) -> Version | None:
    try:
        raw = metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
    return Version(re.split(r"\+", raw, maxsplit=1)[0])


def problems(distribution: str = "mmis") -> list[str]:
    """One sentence per checked package that is missing or outside its declared range."""
    found = []
    for name, req in declared(distribution).items():
        version = installed_version(name)
        if version is None:
            found.append(f"{name} is not installed (mmis needs {spelled(req)})")
        elif not req.specifier.contains(version, prereleases=True):
            found.append(f"{name} {version} is installed; mmis supports {spelled(req)}")
    return found


def require_supported() -> None:
    """Raise :class:`UnsupportedTorchError` with one line when the installed torch or
    torchvision is outside the declared range."""
    found = problems()
    if found:
        raise UnsupportedTorchError(
            "; ".join(found) + " (install a supported release: README, 'Supported torch')"
        )
