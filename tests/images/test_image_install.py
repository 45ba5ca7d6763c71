"""Both images' installs, replayed (tests/images/image_replay.py): each Dockerfile's build-stage
``COPY``/``venv``/``pip install`` steps run as written in a fresh venv, then the commands the
deployments really give that image run against it:

- docker/Dockerfile.operator: the chart's operator container command (charts/mmis/templates/
  deployment.yaml, ``mmis-operator``) with ``--help``; nothing of the model stack installed;
- docker/Dockerfile.server: every container of the pod the operator builds from
  examples/llava-lru.yaml: ``mmis frontend --help``, ``mmis engine --help`` (the pod's
  command and subcommand, not a list kept here), and the model-download init container's
  ``python3 -c`` script (which needs huggingface_hub), run offline; then the image's own
  ``mmis serve`` loads the tiny model and answers an image chat (``scripts/smoke-serve``).

Wheels are kept between runs in a wheelhouse outside the checkout (~/.cache/mmis/wheels;
this machine's PyPI proxy strips cache headers, so pip's own HTTP cache keeps nothing). The
server image's ``pip install .`` puts the whole torch stack (~6 GB installed) into the fresh
venv; that replay is opt-in (``MMIS_IMAGE_REPLAY_SERVER=1``) because it is far too slow for
CI on this project's 2 shared cores (docs/images.md has the figures); the real server image
is built and run by scripts/build-images.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
import image_replay as df

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
CHART_DEPLOYMENT = ROOT / "charts" / "mmis" / "templates" / "deployment.yaml"
HEAVY = ("torch", "transformers", "mmis")


def _replay(name: str, tmp_path: Path) -> tuple[df.Dockerfile, df.Replay, dict[str, str]]:
    parsed = df.parse(DOCKER / name)
    stage, image_venv = df.build_stage(parsed)
    replay = df.replay(parsed, ROOT, tmp_path / "image", stage)
    assert Path(image_venv) in replay.venvs, f"{image_venv} is not a venv the build stage made"
    env = df.image_path_env(parsed, image_venv, replay)
    return parsed, replay, env


def _fresh(replay: df.Replay, env: dict[str, str], tmp_path: Path) -> str:
    """The replayed venv's sys.path: nothing of this test's own environment."""
    proc = df.run_in_image(["python3", "-c", "import sys; print(sys.path)"], env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "/work/main/.venv" not in proc.stdout and str(ROOT / ".venv") not in proc.stdout
    return proc.stdout


def _help(argv: list[str], env: dict[str, str], cwd: Path) -> str:
    proc = df.run_in_image([*argv, "--help"], env, cwd)
    assert proc.returncode == 0, f"{argv} --help exited {proc.returncode}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.slow
def test_operator_image_runs_the_charts_command(tmp_path: Path) -> None:
    parsed, replay, env = _replay("Dockerfile.operator", tmp_path)
    _fresh(replay, env, tmp_path)
    found = re.search(r"^\s+command: \[([^\]]+)\]", CHART_DEPLOYMENT.read_text(), flags=re.M)
    assert found is not None, "the chart's operator container has no command"
    command = [w.strip() for w in found.group(1).split(",")]
    assert command == parsed.entrypoint(), "chart command and image ENTRYPOINT differ"
    out = _help(command, env, tmp_path)
    assert "--liveness-endpoint" in out
    probe = (
        "import importlib.util, sys\n"
        "import mmis_operator.main, mmis_operator.reconciler, mmis_operator.handlers\n"
        "import mmis_operator.probe, mmis_operator.kube\n"
        f"heavy = [m for m in {HEAVY!r} if importlib.util.find_spec(m)]\n"
        "sys.exit(f'installed but not needed: {heavy}' if heavy else 0)\n"
    )
    proc = df.run_in_image(["python3", "-c", probe], env, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _server_pod() -> dict:
    from mmis_operator import builders
    from mmis_operator.spec import parse_spec

    obj = yaml.safe_load((ROOT / "examples" / "llava-lru.yaml").read_text())
    obj["spec"].setdefault("model", {}).pop("path", None)
    return builders.pod_template(parse_spec(obj["spec"]), obj["metadata"]["name"])["spec"]


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("MMIS_IMAGE_REPLAY_SERVER") != "1",
    reason="opt-in (MMIS_IMAGE_REPLAY_SERVER=1): installs the whole torch stack, ~6 GB, into a "
    "fresh venv; too slow for CI here (docs/images.md has the figures)",
)
def test_server_image_runs_every_container_of_the_operators_pod(tmp_path: Path) -> None:
    parsed, replay, env = _replay("Dockerfile.server", tmp_path)
    _fresh(replay, env, tmp_path)
    assert parsed.entrypoint() == ["mmis"]
    pod = _server_pod()
    containers = [*pod.get("initContainers", []), *pod["containers"]]
    ran: list[str] = []
    for c in containers:
        command = c.get("command") or parsed.entrypoint()
        if command == ["mmis"]:
            subcommand = c["args"][0]
            out = _help([*command, subcommand], env, tmp_path)
            assert f"mmis {subcommand}" in out
            ran.append(f"mmis {subcommand} --help")
        elif command[:2] == ["python3", "-c"]:
            # the download script, offline: it must get as far as huggingface_hub's lookup
            offline = {**env, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
            proc = df.run_in_image([*command, "mmis-test/absent", ""], offline, tmp_path)
            assert "ModuleNotFoundError" not in proc.stderr, proc.stderr[-3000:]
            assert "ImportError" not in proc.stderr, proc.stderr[-3000:]
            assert "LocalEntryNotFoundError" in proc.stderr, proc.stderr[-3000:]
            ran.append(f"{c['name']}: python3 -c <download script>")
        else:
            pytest.fail(f"container {c['name']}: a command this test does not know: {command}")
    assert {"mmis frontend --help", "mmis engine --help"} <= set(ran), ran
    # the image serves: its own `mmis serve` loads the tiny model and answers an image chat
    _, image_venv = df.build_stage(parsed)
    offline = {**env, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    smoke = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "smoke-serve"), str(replay.host(image_venv))],
        env=offline,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert smoke.returncode == 0, smoke.stdout + smoke.stderr[-3000:]
    print(smoke.stdout)
    # the image ships the server, not the operator
    proc = df.run_in_image(
        ["python3", "-c", "import importlib.util as u; print(u.find_spec('mmis_operator'))"],
        env,
        tmp_path,
    )
    assert proc.stdout.strip() == "None", proc.stdout


def test_every_run_step_is_understood() -> None:
    """Cheap and always on: both Dockerfiles parse, and each build stage's steps are ones the
    replay knows (a new kind of step must teach tests/images/image_replay.py)."""
    for name in ("Dockerfile.operator", "Dockerfile.server"):
        parsed = df.parse(DOCKER / name)
        stage, image_venv = df.build_stage(parsed)
        kinds = [kind for kind, _ in df.run_steps(stage)]
        assert "venv" in kinds and "pip" in kinds, f"{name}: {kinds}"
        assert parsed.entrypoint(), name
        assert image_venv == "/opt/mmis", name


def test_unknown_run_step_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "Dockerfile"
    path.write_text(
        "FROM x AS build\nRUN python -m venv /opt/mmis\nRUN curl -o /x https://example\n"
        "RUN /opt/mmis/bin/pip install ./operator\nFROM x\nCOPY --from=build /opt/mmis /opt/mmis\n"
        'ENV PATH=/opt/mmis/bin:$PATH\nENTRYPOINT ["mmis-operator"]\n'
    )
    parsed = df.parse(path)
    stage, _ = df.build_stage(parsed)
    with pytest.raises(df.DockerfileError, match="does not understand"):
        df.replay(parsed, ROOT, tmp_path / "image", stage)
