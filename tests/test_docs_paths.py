"""docs/ARCHITECTURE.md names only paths that exist: a newcomer's walk through the code must not
lead to a moved or deleted file (issue 34: the document had drifted from the tree).

Every backticked token that looks like a path (ends in a file suffix or ``/``, or has a
``/`` inside: ``pkg/events``, ``scripts/build-images``) is resolved: from the repository
root, else under ``server/`` or ``server/mmis/`` (the document names server modules as
``engine/core.py``), else under ``operator/mmis_operator/``, else under the root of a Go
module of the tree (the document names Go packages as Go does, from their module:
``pkg/events`` of ``mmis.dev/router`` is ``router/pkg/events``); a token that starts with a
domain is a Go import path, checked when it names one of the tree's modules
(``mmis.dev/router`` is ``router/``) and otherwise an outside reference. A bare file name
(``spec.py``, in a paragraph about one package) must exist somewhere in the tracked tree.
URL paths (``/v1/...``), URLs, globs, MIME types (``image/png``) and API versions
(``apps/v1``) are not paths.

The documentation site (issue 48): every relative Markdown link of ``README.md`` and
``docs/**/*.md`` names a file that exists (from the page's folder), and the pages written for
the site name only paths that exist, by the same rules as ARCHITECTURE.md.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
SUFFIXES = (".py", ".md", ".yaml", ".yml", ".toml", ".json", ".go", ".sh", ".txt")
TOKEN = re.compile(r"`([^`\s]+)`")
DOMAIN = re.compile(r"[a-z0-9-]+(\.[a-z0-9-]+)+")  # the first part of a Go import path
MIME = ("application", "audio", "font", "image", "message", "model", "multipart", "text", "video")
API_VERSION = re.compile(r"v\d+((alpha|beta)\d+)?")


def tracked_files() -> list[str]:
    return subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()


def go_modules() -> dict[str, Path]:
    """Module path -> its directory, for every tracked go.mod."""
    modules = {}
    for f in tracked_files():
        if f == "go.mod" or f.endswith("/go.mod"):
            match = re.search(r"^module\s+(\S+)", (ROOT / f).read_text(), re.M)
            if match:
                modules[match.group(1)] = (ROOT / f).parent
    return modules


MODULES = go_modules()
BASES = (
    ROOT,
    ROOT / "server",
    ROOT / "server" / "mmis",
    ROOT / "operator" / "mmis_operator",
    *MODULES.values(),
)


def _module_of(token: str) -> str | None:
    """The tree's Go module that ``token`` (an import path) is in, or None."""
    for module in MODULES:
        if token == module or token.startswith(module + "/"):
            return module
    return None


def _is_path(token: str) -> bool:
    if token.endswith(SUFFIXES) or (token.endswith("/") and len(token) > 1):
        return True
    if "/" not in token:
        return False  # a bare word: a name, not a path
    first, _, rest = token.partition("/")
    if first in MIME or API_VERSION.fullmatch(rest.split("/")[0]):
        return False  # image/png, apps/v1
    if DOMAIN.fullmatch(first) and not (ROOT / first).exists():
        return _module_of(token) is not None  # an import path: ours is checked
    return True


def named_paths(text: str) -> list[str]:
    out = []
    for token in TOKEN.findall(text):
        token = token.split("::")[0].rstrip(".,;:")
        if token.startswith(("/", "$", "~", "-")) or "://" in token or "*" in token or "{" in token:
            continue
        if _is_path(token):
            out.append(token)
    return sorted(set(out))


def tracked_names() -> set[str]:
    names = set()
    for f in tracked_files():
        parts = f.split("/")
        names.add(parts[-1])
        names.update(p + "/" for p in parts[:-1])
    return names


def exists(path: str, names: set[str]) -> bool:
    if "/" not in path.rstrip("/"):  # a bare file or folder name
        return path in names
    module = _module_of(path)
    if module is not None:  # a Go import path of this tree: its module's directory
        return (MODULES[module] / path[len(module) :].lstrip("/")).exists()
    return any((base / path).exists() for base in BASES)


def test_every_path_architecture_names_exists() -> None:
    paths = named_paths(DOC.read_text())
    assert len(paths) > 50, "the parser found too few paths: check TOKEN/SUFFIXES"
    names = tracked_names()
    missing = [p for p in paths if not exists(p, names)]
    assert not missing, f"docs/ARCHITECTURE.md names paths that do not exist: {missing}"


def test_the_walk_of_one_chat_names_its_files_by_path() -> None:
    """§1 walks one chat with an image through the code, naming each file by its path; side
    paths live in §1b. Its length is held to the truth, not to a bound (issue 45 replaced
    issue 34's 25 files): ``tests/e2e/test_request_walk.py`` runs that request and fails
    unless the walk names exactly the modules it executes."""
    text = DOC.read_text()
    walk = text[text.index("## 1. ") : text.index("## 1b. ")]
    files = {p for p in named_paths(walk) if p.endswith(".py")}
    bare = {p for p in files if "/" not in p}
    assert not {b for b in bare if not any(f.endswith("/" + b) for f in files - bare)}, (
        "name the walk's files by their path"
    )


def test_the_check_can_fail() -> None:
    names = tracked_names()
    assert not exists("engine/no_such_module.py", names)
    assert not exists("no_such_module.py", names)
    assert exists("engine/core.py", names) and exists("pyproject.toml", names)
    # paths without a suffix: folders and scripts, Go packages from their module's root
    assert exists("pkg/events", names) and exists("scripts/build-images", names)
    assert not exists("pkg/no_such_package", names) and not exists("scripts/no-such", names)
    assert exists("mmis.dev/router", names) and exists("mmis.dev/router/pkg/mmiscache", names)
    assert not exists("mmis.dev/router/pkg/no_such_package", names)


def test_paths_without_a_suffix_are_found() -> None:
    text = (
        "`pkg/events` `scripts/build-images` `mmis.dev/router` `mmis.dev/router/pkg/x`"
        " `image/png` `apps/v1` `github.com/a/b` `word` `docs/`"
    )
    assert named_paths(text) == [
        "docs/",
        "mmis.dev/router",
        "mmis.dev/router/pkg/x",
        "pkg/events",
        "scripts/build-images",
    ]
    assert {"pkg/events", "pkg/mmiscache", "mmis.dev/router"} <= set(named_paths(DOC.read_text()))


# --- the documentation site and the README (issue 48) -------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# the pages written for the site and the README: every backticked path they name exists (the
# older design pages, and the generated references, name example paths: links only there)
NAMING_PAGES = (
    "README.md",
    "docs/index.md",
    "docs/getting-started.md",
    "docs/models.md",
    "docs/api.md",
    "docs/lora.md",
    "docs/kubernetes.md",
    "docs/encoders.md",
    "docs/observability.md",
    "docs/operations.md",
    "docs/benchmarks.md",
    "docs/development.md",
)


def link_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def broken_links(page: Path) -> list[str]:
    """The relative link targets of Markdown ``page`` that name no file or folder (anchors
    are mkdocs' to check: ``tests/test_docs_site.py`` builds with ``--strict``)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor of the page itself
        path = target.split("#")[0]
        if not (page.parent / path).exists():
            bad.append(target)
    return bad


def test_every_relative_link_of_the_docs_and_readme_exists() -> None:
    pages = link_pages()
    assert len(pages) >= 15, "the site's pages were not found"
    assert sum(len(LINK.findall(p.read_text())) for p in pages) > 40, "the link parser found few"
    bad = {str(p.relative_to(ROOT)): broken_links(p) for p in pages}
    assert not {k: v for k, v in bad.items() if v}


def test_the_link_check_can_fail(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("x")
    page.write_text(
        "[ok](there.md#a) [gone](missing.md) ![pic](nope.svg) [web](https://x.y/z.md) [a](#b)\n"
        "```\n[in code](ignored.md)\n```\n"
    )
    assert broken_links(page) == ["missing.md", "nope.svg"]


@pytest.mark.parametrize("page", NAMING_PAGES)
def test_every_path_a_site_page_names_exists(page: str) -> None:
    names = tracked_names()
    missing = [p for p in named_paths((ROOT / page).read_text()) if not exists(p, names)]
    assert not missing, f"{page} names paths that do not exist: {missing}"
