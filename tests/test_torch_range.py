"""The supported torch range (issue 42): one declaration, both ends tested, refusal outside it.

- ``pyproject.toml`` declares ranges for torch and torchvision (never one pin), and
  ``constraints.txt`` (the developer's install, the server image, CI's main run) names a pair
  inside them: the upper end. ``scripts/lowest-torch`` installs the lower bounds it reads from
  ``pyproject.toml`` and runs the model tests there (CI's last step).
- :mod:`mmis.torch_support` judges an installed release against the declared requirement,
  and ``mmis`` refuses a torch outside it before importing anything (one line). The refusal of a
  real older torch is CI's ``scripts/lowest-torch older``; here the rule itself is tested with
  the metadata lookups replaced (a unit test of one piece).
- The lowest run's test list reaches every module of ``server/mmis`` that imports torch:
  each is named by a test module in that list, or is a model adapter the engine picks by
  ``model_type`` for a family whose parity test is in the list.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from mmis import torch_support

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "lowest-torch"


def _declared() -> dict[str, Requirement]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = [Requirement(d) for d in deps]
    return {r.name: r for r in reqs if r.name in ("torch", "torchvision", "transformers")}


def _constraints() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name.strip()] = Version(version.strip())
    return pins


def test_pyproject_declares_ranges_and_constraints_pick_a_pair_inside_them() -> None:
    declared = _declared()
    for name in ("torch", "torchvision", "transformers"):
        spec = declared[name].specifier
        assert any(s.operator == ">=" for s in spec), f"{name} needs a lower bound: {spec}"
        assert any(s.operator == "<" for s in spec), f"{name} needs an upper bound: {spec}"
        assert not any(s.operator == "==" for s in spec), f"{name} is pinned: {spec}"
    assert declared["torch"].specifier.contains("2.11.0"), "the device image's torch 2.11"
    pins = _constraints()
    assert {"torch", "torchvision"} <= set(pins)
    for name in ("torch", "torchvision"):
        version = pins[name]
        assert declared[name].specifier.contains(version), f"constraints.txt {name} {version}"
    # beyond the torch pair only the dev extra's tools are pinned: a runtime dependency pinned
    # here would make the developer's install differ from a user's `pip install .`
    runtime = {
        Requirement(d).name
        for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    }
    assert not (set(pins) - {"torch", "torchvision"}) & runtime


def test_the_refusal_names_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = ["torch>=2.11,<2.15", "torchvision>=0.26,<0.30", "numpy>=2"]
    installed = {"torch": "2.10.0+cu128", "torchvision": "0.26.0"}
    monkeypatch.setattr(metadata, "requires", lambda dist: reqs)
    monkeypatch.setattr(metadata, "version", lambda name: installed[name])
    with pytest.raises(torch_support.UnsupportedTorchError) as err:
        torch_support.require_supported()
    message = str(err.value)
    assert "torch 2.10.0 is installed; mmis supports torch>=2.11,<2.15" in message
    assert "torchvision" not in message.split(";")[0] or "torchvision 0.26.0" not in message
    assert "\n" not in message

    installed["torch"] = "2.11.0+cu130"  # a local label is not a different release
    torch_support.require_supported()
    installed["torch"] = "2.15.0"
    with pytest.raises(torch_support.UnsupportedTorchError, match=r"torch 2\.15\.0 is installed"):
        torch_support.require_supported()


def test_a_missing_torch_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metadata, "requires", lambda dist: ["torch>=2.11,<2.15"])

    def version(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", version)
    assert torch_support.problems() == ["torch is not installed (mmis needs torch>=2.11,<2.15)"]


def test_the_running_torch_is_inside_the_range() -> None:
    """The installed metadata may predate an edit of pyproject.toml (an editable install is
    not re-read); judge the running torch against the source's declaration."""
    import torch

    version = Version(torch.__version__.split("+")[0])
    assert _declared()["torch"].specifier.contains(version)


def test_mmis_refuses_before_importing_torch() -> None:
    """The check reads metadata only: ``mmis.torch_support`` and the dispatch import no torch."""
    code = (
        "import sys; import mmis.torch_support, mmis.cli; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _lowest_tests() -> list[Path]:
    text = SCRIPT.read_text()
    block = re.search(r"^TESTS=\((.*?)^\)", text, re.S | re.M)
    assert block, "scripts/lowest-torch has no TESTS=( ... ) list"
    return [ROOT / word for word in block.group(1).split()]


def _imports(path: Path) -> set[str]:
    """Every module name ``path`` imports (at any depth of its code)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_the_lowest_run_reaches_every_module_that_imports_torch() -> None:
    """A module is reached when a test of the list names it, when a reached module imports
    it, or when it is a model adapter (or tiny model) of a family the list's tests name."""
    tests = _lowest_tests()
    missing = [str(p.relative_to(ROOT)) for p in tests if not p.exists()]
    assert not missing, f"scripts/lowest-torch names tests that do not exist: {missing}"
    files = [f for p in tests for f in ([p] if p.is_file() else sorted(p.rglob("*.py")))]
    text = "\n".join(f.read_text() for f in files)
    server = ROOT / "server"
    adapters = server / "mmis" / "engine" / "execution" / "model"
    modules: dict[str, Path] = {}
    for path in sorted((server / "mmis").rglob("*.py")):
        name = ".".join(path.relative_to(server).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    imports = {name: _imports(path) & modules.keys() for name, path in modules.items()}
    reached = set()
    for name, path in modules.items():
        short = name.rsplit(".", 1)[-1]
        family = short.removeprefix("tiny_").replace("_", "[_-]?")
        by_family = path.parent == adapters or ".tiny_models." in name
        if re.search(rf"{re.escape(name)}\b|import[^\n]*\b{short}\b", text) or (
            by_family and re.search(rf"\b{family}\b", text)
        ):
            reached.add(name)
    frontier = list(reached)
    while frontier:
        for dep in imports[frontier.pop()] - reached:
            reached.add(dep)
            frontier.append(dep)
    torch_modules = {
        n for n, p in modules.items() if any(i.split(".")[0] == "torch" for i in _imports(p))
    }
    unreached = sorted(torch_modules - reached - {"mmis.torch_support"})
    assert not unreached, f"no test of the lowest-torch run reaches {unreached}"
