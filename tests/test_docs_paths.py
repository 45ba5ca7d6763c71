"""docs/ARCHITECTURE.md names only paths that exist: a newcomer's walk through the code must not
lead to a moved or deleted file (issue 34: the document had drifted from the tree).

Every backticked token that looks like a path (ends in a file suffix or ``/``) is resolved:
from the repository root, else under ``server/`` or ``server/mmis/`` (the document names
server modules as ``engine/core.py``), else under ``operator/mmis_operator/``; a bare file
name (``spec.py``, in a paragraph about one package) must exist somewhere in the tracked
tree. URL paths (``/v1/...``), URLs and globs are not paths.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
SUFFIXES = (".py", ".md", ".yaml", ".yml", ".toml", ".json", ".go", ".sh", ".txt")
BASES = (ROOT, ROOT / "server", ROOT / "server" / "mmis", ROOT / "operator" / "mmis_operator")
TOKEN = re.compile(r"`([^`\s]+)`")


def named_paths(text: str) -> list[str]:
    out = []
    for token in TOKEN.findall(text):
        token = token.split("::")[0].rstrip(".,;:")
        if token.startswith(("/", "$", "~", "-")) or "://" in token or "*" in token or "{" in token:
            continue
        if token.endswith(SUFFIXES) or (token.endswith("/") and len(token) > 1):
            out.append(token)
    return sorted(set(out))


def tracked_names() -> set[str]:
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    names = set()
    for f in files:
        parts = f.split("/")
        names.add(parts[-1])
        names.update(p + "/" for p in parts[:-1])
    return names


def exists(path: str, names: set[str]) -> bool:
    if "/" not in path.rstrip("/"):  # a bare file or folder name
        return path in names
    return any((base / path).exists() for base in BASES)


def test_every_path_architecture_names_exists() -> None:
    paths = named_paths(DOC.read_text())
    assert len(paths) > 50, "the parser found too few paths: check TOKEN/SUFFIXES"
    names = tracked_names()
    missing = [p for p in paths if not exists(p, names)]
    assert not missing, f"docs/ARCHITECTURE.md names paths that do not exist: {missing}"


def test_the_walk_of_one_chat_names_at_most_25_files() -> None:
    """§1 walks one chat with an image through the code; side paths live in §1b (issue 34: a
    newcomer follows one request through at most 25 files)."""
    text = DOC.read_text()
    walk = text[text.index("## 1. ") : text.index("## 1b. ")]
    files = {p for p in named_paths(walk) if p.endswith(".py")}
    bare = {p for p in files if "/" not in p}
    assert not {b for b in bare if not any(f.endswith("/" + b) for f in files - bare)}, (
        "name the walk's files by their path"
    )
    assert len(files - bare) <= 25, sorted(files - bare)


def test_the_check_can_fail() -> None:
    names = tracked_names()
    assert not exists("engine/no_such_module.py", names)
    assert not exists("no_such_module.py", names)
    assert exists("engine/core.py", names) and exists("pyproject.toml", names)
