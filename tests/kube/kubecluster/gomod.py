"""Files of pinned Go modules the tests read (CRDs of APIs mmis uses), from the Go module
cache ``scripts/gotools`` uses: ``$MMIS_GO_CACHE/mod`` (default ``~/.cache/mmis/go/mod``).

Invariants:
  * a file is read from the module cache exactly as ``go mod download MODULE@VERSION`` puts
    it there (checked against the Go checksum database by ``go`` itself); a missing module is
    downloaded once, with that command, into that cache, never into the checkout;
  * whatever cannot be had is reported as ``ToolsMissing`` with the command that fixes it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from .tools import ToolsMissing

# the Gateway API Inference Extension release mmis's endpoint picker builds on (router/,
# docs/ROUTING.md); its InferencePool is the inference.networking.k8s.io/v1 of every v1.x
INFERENCE_EXTENSION = ("sigs.k8s.io/gateway-api-inference-extension", "v1.5.0")
INFERENCE_POOL_CRD = "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"


def go_mod_cache() -> Path:
    configured = os.environ.get("MMIS_GO_CACHE")
    base = Path(configured) if configured else Path.home() / ".cache" / "mmis" / "go"
    return base / "mod"


def _escaped(module: str) -> str:
    """The module path as the module cache spells it (an upper-case letter is ``!`` + lower)."""
    return "".join(f"!{c.lower()}" if c.isupper() else c for c in module)


def _go() -> str | None:
    found = shutil.which("go")
    if found:
        return found
    return "/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").is_file() else None


def download_command(module: str, version: str) -> str:
    return f"GOMODCACHE={go_mod_cache()} GOFLAGS=-mod=mod go mod download {module}@{version}"


def module_file(module: str, version: str, relative: str, timeout: float = 600.0) -> Path:
    """``relative`` inside ``module@version``, downloading the module first if needed."""
    path = go_mod_cache() / f"{_escaped(module)}@{version}" / relative
    if path.is_file():
        return path
    how = f"run `{download_command(module, version)}` (from any directory)"
    go = _go()
    if go is None:
        raise ToolsMissing(f"{path} is missing and Go is not installed: install Go, then {how}")
    env = {**os.environ, "GOMODCACHE": str(go_mod_cache()), "GOFLAGS": "-mod=mod"}
    with tempfile.TemporaryDirectory() as scratch:  # outside any module of the checkout
        proc = subprocess.run(
            [go, "mod", "download", f"{module}@{version}"],
            cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
    if proc.returncode != 0 or not path.is_file():
        detail = (proc.stderr or proc.stdout).strip()[-1000:]
        raise ToolsMissing(f"{path} is missing and `go mod download` failed ({detail}); {how}")
    return path


def inference_pool_crd() -> Path:
    """The InferencePool CRD (``inference.networking.k8s.io/v1``) of :data:`INFERENCE_EXTENSION`."""
    return module_file(*INFERENCE_EXTENSION, INFERENCE_POOL_CRD)
