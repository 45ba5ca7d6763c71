"""Finding (and, if allowed, building) the binaries of the test control plane.

Invariants:
  * Go tools are looked up only in ``$MMIS_TOOLS_DIR/bin`` (default
    ``~/.cache/mmis/tools/bin``), the directory ``scripts/gotools`` fills; never on PATH,
    so a stray kubectl of another version is never picked up;
  * etcd comes from ``$MMIS_ETCD``, else PATH, else ``/usr/bin/etcd`` (``scripts/system-deps``);
  * whatever cannot be had is reported as ``ToolsMissing`` with the command that fixes it;
    building is attempted only when the caller asks for it and Go is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

GO_TOOLS = (
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
    "helm",
)
REPO_ROOT = Path(__file__).resolve().parents[3]
GOTOOLS_SCRIPT = REPO_ROOT / "scripts" / "gotools"


class ToolsMissing(RuntimeError):
    """A binary the control plane needs is absent; the message says how to get it."""


@dataclass(frozen=True)
class Tools:
    bin_dir: Path
    etcd: Path

    def path(self, name: str) -> Path:
        if name == "etcd":
            return self.etcd
        exe = self.bin_dir / name
        if not exe.is_file():
            raise ToolsMissing(f"{exe} does not exist (known tools: {', '.join(GO_TOOLS)})")
        return exe


def tools_dir() -> Path:
    configured = os.environ.get("MMIS_TOOLS_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "mmis" / "tools"


def go_available() -> bool:
    return shutil.which("go") is not None or Path("/usr/local/go/bin/go").is_file()


def _missing_go_tools() -> list[str]:
    """Tools absent or not at their pinned version (as ``scripts/gotools --check`` judges)."""
    bin_dir = tools_dir() / "bin"
    absent = [t for t in GO_TOOLS if not (bin_dir / t).is_file()]
    if absent or not GOTOOLS_SCRIPT.is_file():
        return absent
    proc = subprocess.run(
        [str(GOTOOLS_SCRIPT), "--check"], capture_output=True, text=True, check=False
    )
    if proc.returncode == 0:
        return []
    # "scripts/gotools: missing or outdated in DIR: a b c"
    return proc.stderr.strip().rpartition(": ")[2].split() or list(GO_TOOLS)


def find_etcd() -> Path:
    configured = os.environ.get("MMIS_ETCD")
    candidates = [configured] if configured else [shutil.which("etcd"), "/usr/bin/etcd"]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    where = f"MMIS_ETCD={configured}" if configured else "PATH and /usr/bin"
    raise ToolsMissing(f"etcd not found in {where}: run scripts/system-deps")


def build_go_tools(log: Path | None = None) -> None:
    """Run ``scripts/gotools`` (slow the first time: tens of minutes on two cores)."""
    if not go_available():
        raise ToolsMissing(
            f"Go tools missing in {tools_dir() / 'bin'} and Go is not installed: "
            "install Go >= 1.26, then run scripts/gotools"
        )
    out = log.open("ab") if log is not None else None
    try:
        proc = subprocess.run(
            [str(GOTOOLS_SCRIPT)],
            stdout=out if out is not None else subprocess.PIPE,
            stderr=subprocess.STDOUT,
            check=False,
        )
    finally:
        if out is not None:
            out.close()
    if proc.returncode != 0:
        detail = f"see {log}" if log is not None else (proc.stdout or b"").decode()[-2000:]
        raise ToolsMissing(f"scripts/gotools failed ({proc.returncode}): {detail}")


def find_tools(build: bool = False, log: Path | None = None) -> Tools:
    """All binaries, building the Go ones first when ``build`` and they are missing."""
    etcd = find_etcd()
    missing = _missing_go_tools()
    if missing and build:
        build_go_tools(log)
        missing = _missing_go_tools()
    if missing:
        raise ToolsMissing(
            f"missing or outdated in {tools_dir() / 'bin'}: {', '.join(missing)}; "
            "run scripts/gotools (or set MMIS_TOOLS_DIR to where they are built)"
        )
    return Tools(bin_dir=tools_dir() / "bin", etcd=etcd)
