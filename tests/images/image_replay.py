"""A Dockerfile's Python install, replayed on this machine: the build stage's ``COPY``,
``WORKDIR``, ``python -m venv`` and ``pip install`` steps run as written, in a fresh
directory standing in for the image's filesystem, so the venv the image ships is the venv the
test runs.

Invariants:

- The steps come from the Dockerfile itself (docker/Dockerfile.*), never from a list kept
  here: a Dockerfile change that breaks an entry point fails the replay.
- Every ``RUN`` line is either replayed (venv creation, pip) or recognised as a system step
  (apt-get, useradd, ...) that a venv cannot replay; any other ``RUN`` line is an error, so
  a new build step is never silently ignored.
- The venv is fresh: made by ``venv`` from the base interpreter, no ``--system-site-packages``
  (nothing of the test's own .venv leaks in).
- Image paths are rooted under the replay directory (``/opt/mmis`` -> ``<root>/opt/mmis``);
  the final stage must copy the venv out of the build stage and put its ``bin`` first on
  ``PATH``, else the image's entry point would not be the replayed one.
- Wheels are reused between replays from a wheelhouse outside the checkout
  (``MMIS_WHEELHOUSE``, default ~/.cache/mmis/wheels); the Dockerfile's ``PIP_NO_CACHE_DIR``
  only keeps the image small and is not applied. A warm replay downloads no wheel again but
  still resolves against the index and installs every wheel into the fresh venv (without
  byte-compiling: ``PIP_NO_COMPILE``, bytecode changes nothing of what is installed).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import time
import tomllib
import venv
from pathlib import Path

# system steps a venv replay cannot (and need not) run: the image's OS packages and user
SYSTEM_COMMANDS = ("apt-get", "groupadd", "useradd", "rm", "ln", "mkdir", "chown", "chmod")
CACHE_ENV = ("PIP_NO_CACHE_DIR",)


class DockerfileError(AssertionError):
    """The Dockerfile has a step the replay does not understand, or a broken layout."""


@dataclasses.dataclass
class Stage:
    base: str
    name: str | None
    steps: list[tuple[str, str]]  # (INSTRUCTION, rest of the line)

    def all(self, op: str) -> list[str]:
        return [rest for o, rest in self.steps if o == op]


@dataclasses.dataclass
class Dockerfile:
    path: Path
    args: dict[str, str]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise DockerfileError(f"{self.path.name}: no stage named {name!r}")

    def entrypoint(self) -> list[str]:
        lines = self.final.all("ENTRYPOINT")
        if not lines:
            raise DockerfileError(f"{self.path.name}: the final stage has no ENTRYPOINT")
        return list(json.loads(lines[-1]))

    def env(self, stage: Stage) -> dict[str, str]:
        env: dict[str, str] = {}
        for rest in stage.all("ENV"):
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value
        return env


def parse(path: Path) -> Dockerfile:
    """Stages and their instructions; continuation lines joined, comments dropped."""
    lines: list[str] = []
    for raw in path.read_text().replace("\\\n", " ").splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            lines.append(line)
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        op, _, rest = line.partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=words[0], name=name, steps=[]))
        elif not stages and op == "ARG":
            key, _, value = rest.partition("=")
            args[key] = value
        elif not stages:
            raise DockerfileError(f"{path.name}: {op} before the first FROM")
        else:
            stages[-1].steps.append((op, rest))
    if not stages:
        raise DockerfileError(f"{path.name}: no FROM")
    return Dockerfile(path=path, args=args, stages=stages)


def strip_run_flags(rest: str) -> str:
    while rest.startswith("--"):  # RUN --mount=... --network=...
        _, _, rest = rest.partition(" ")
        rest = rest.lstrip()
    return rest


VENV_RE = re.compile(r"(?:/\S+/)?python3?(?:\.\d+)? -m venv (/\S+)")


def classify(cmd: str) -> str:
    """``venv``, ``pip`` or ``system`` for one RUN command; DockerfileError for anything else."""
    if VENV_RE.fullmatch(cmd):
        return "venv"
    if "pip install" in cmd:
        return "pip"
    if cmd.split()[0] in SYSTEM_COMMANDS:
        return "system"
    raise DockerfileError(
        "a RUN step the replay does not understand (teach tests/images/image_replay.py): " + cmd
    )


def run_steps(stage: Stage) -> list[tuple[str, str]]:
    """(kind, command) of each RUN step of ``stage``, all classified before any runs."""
    steps = []
    for rest in stage.all("RUN"):
        cmd = strip_run_flags(rest)
        steps.append((classify(cmd), cmd))
    return steps


def _copy(rest: str, context: Path, workdir: Path, root: Path) -> None:
    words = [w for w in shlex.split(rest) if not w.startswith("--")]
    *sources, dest = words
    target = root / dest.lstrip("/") if dest.startswith("/") else workdir / dest
    for src in sources:
        source = context / src
        if source.is_dir():
            dst = target if len(sources) == 1 and not dest.endswith("/") else target / src
            shutil.copytree(
                source,
                dst,
                dirs_exist_ok=True,
                ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build"),
            )
        else:
            target.mkdir(parents=True, exist_ok=True) if dest.endswith("/") else None
            shutil.copy2(source, target / src if dest.endswith("/") else target)


@dataclasses.dataclass
class Replay:
    root: Path  # stands in for the image's /
    venvs: list[Path]  # image paths of the venvs made (e.g. /opt/mmis)
    pip_lines: list[str]
    skipped: list[str]
    log: str

    def host(self, image_path: str) -> Path:
        return self.root / image_path.lstrip("/")


def _map_paths(cmd: str, venvs: list[Path], root: Path) -> str:
    for v in venvs:
        cmd = re.sub(
            rf"(?<![\w/]){re.escape(str(v))}(?=[/\s]|$)", str(root / str(v).lstrip("/")), cmd
        )
    return cmd


def wheelhouse_dir() -> Path:
    """Where downloaded wheels are kept between replays (outside the checkout)."""
    default = Path.home() / ".cache" / "mmis" / "wheels"
    return Path(os.environ.get("MMIS_WHEELHOUSE", default))


def _build_requires(pip_install: str, workdir: Path) -> list[str]:
    """[build-system].requires of the local projects a pip line installs (pip fetches them
    into its isolated build environment, which ``pip download`` does not keep)."""
    out: list[str] = []
    for word in shlex.split(pip_install.partition("pip install")[2]):
        project = workdir / word / "pyproject.toml"
        if not word.startswith("-") and project.is_file():
            out += tomllib.loads(project.read_text()).get("build-system", {}).get("requires", [])
    return out


def _as_download(pip_install: str, wheelhouse: Path, extra: list[str]) -> str:
    """The same pip line as a ``pip download`` into the wheelhouse (plus ``extra``
    requirements): pip resolves the line's requirements against the index and fetches only
    the wheels the wheelhouse lacks."""
    before, _, args = pip_install.partition("pip install")
    more = " ".join(shlex.quote(r) for r in extra)
    return f"{before}pip download --dest {shlex.quote(str(wheelhouse))} {args} {more}".rstrip()


def replay(
    dockerfile: Dockerfile,
    context: Path,
    root: Path,
    stage: Stage,
    wheelhouse: Path | None = None,
) -> Replay:
    """Run ``stage``'s COPY/WORKDIR/venv/pip steps with ``context`` as the build context.

    Each ``pip install`` line runs twice: first as ``pip download`` into the wheelhouse (this
    machine's PyPI proxy strips cache headers, so pip's own HTTP cache stores nothing), then
    exactly as written with the wheelhouse on ``PIP_FIND_LINKS`` and ``PIP_NO_INDEX``: pip
    resolves the line itself, offline, from the set the download step just resolved from the
    index. ``Replay.log`` has each step's output and wall time."""
    wheelhouse = wheelhouse or wheelhouse_dir()
    root.mkdir(parents=True, exist_ok=True)
    workdir = root
    env = dict(os.environ)
    for key, value in dockerfile.env(stage).items():
        if key not in CACHE_ENV:
            env[key] = value
    env.pop("PIP_NO_CACHE_DIR", None)
    env.pop("VIRTUAL_ENV", None)
    env["PIP_NO_COMPILE"] = "1"  # bytecode changes nothing of what is installed; saves CPU
    wheelhouse.mkdir(parents=True, exist_ok=True)
    env["PIP_FIND_LINKS"] = " ".join(filter(None, [str(wheelhouse), env.get("PIP_FIND_LINKS")]))
    venvs: list[Path] = []
    pip_lines: list[str] = []
    skipped: list[str] = []
    log: list[str] = []
    kinds = iter(run_steps(stage))  # every RUN step understood before anything runs
    for op, rest in stage.steps:
        if op == "WORKDIR":
            workdir = root / rest.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif op == "COPY":
            if "--from=" in rest:
                raise DockerfileError(f"{dockerfile.path.name}: COPY --from in the build stage")
            _copy(rest, context, workdir, root)
        elif op == "RUN":
            kind, cmd = next(kinds)
            made = VENV_RE.fullmatch(cmd)
            if made:
                image_venv = Path(made.group(1))
                t0 = time.monotonic()
                venv.EnvBuilder(with_pip=True, clear=True).create(root / str(image_venv)[1:])
                log.append(f"$ {cmd}  # {time.monotonic() - t0:.1f} s")
                venvs.append(image_venv)
            elif "pip install" in cmd:
                mapped = _map_paths(cmd, venvs, root)
                if mapped == cmd:
                    raise DockerfileError(f"pip outside the image's venv: {cmd}")
                download = _as_download(mapped, wheelhouse, _build_requires(mapped, workdir))
                # the install resolves again, offline, from the set the download just resolved
                # from the index (plus older wheels, which lose to those newest ones)
                offline = {**env, "PIP_NO_INDEX": "1"}
                for step, step_env in ((download, env), (mapped, offline)):
                    t0 = time.monotonic()
                    proc = subprocess.run(
                        step, shell=True, cwd=workdir, env=step_env, capture_output=True, text=True
                    )
                    took = time.monotonic() - t0
                    out = f"{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
                    log.append(f"$ {step}  # {took:.1f} s\n{out}")
                    if proc.returncode != 0:
                        raise DockerfileError(f"{dockerfile.path.name}: `{cmd}` failed\n{log[-1]}")
                pip_lines.append(cmd)
            else:
                assert kind == "system", kind
                skipped.append(cmd)
        elif op in ("ENV", "ARG", "LABEL", "EXPOSE", "USER"):
            continue
        else:
            raise DockerfileError(f"{dockerfile.path.name}: {op} in the build stage: {rest}")
    if not pip_lines:
        raise DockerfileError(f"{dockerfile.path.name}: no `pip install` step in its build stage")
    return Replay(root=root, venvs=venvs, pip_lines=pip_lines, skipped=skipped, log="\n".join(log))


def build_stage(dockerfile: Dockerfile) -> tuple[Stage, str]:
    """The stage the final stage copies its venv from, and that venv's image path."""
    for rest in dockerfile.final.all("COPY"):
        found = re.fullmatch(r"--from=(\S+)\s+(/\S+)\s+(/\S+)", rest)
        if found and found.group(2) == found.group(3):
            return dockerfile.stage(found.group(1)), found.group(2)
    raise DockerfileError(f"{dockerfile.path.name}: the final stage copies no venv from a stage")


def image_path_env(dockerfile: Dockerfile, image_venv: str, replay: Replay) -> dict[str, str]:
    """The final stage's environment with its PATH mapped onto the replay (and checked)."""
    env = dockerfile.env(dockerfile.final)
    path = env.get("PATH", "").replace("$PATH", "").split(":")
    if not path or path[0] != f"{image_venv}/bin":
        raise DockerfileError(f"{dockerfile.path.name}: {image_venv}/bin is not first on PATH")
    out = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    out.update({k: v for k, v in env.items() if k != "PATH"})
    out["PATH"] = f"{replay.host(image_venv)}/bin:/usr/bin:/bin"
    out["PYTHONNOUSERSITE"] = "1"
    return out


def run_in_image(
    argv: list[str], env: dict[str, str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    """Resolve argv[0] on the image's PATH, as the container runtime would, and run it."""
    exe = shutil.which(argv[0], path=env["PATH"])
    if exe is None:
        raise DockerfileError(f"`{argv[0]}` is not on the image's PATH ({env['PATH']})")
    return subprocess.run(
        [exe, *argv[1:]], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )
