"""``--revision`` / ``--processor-kwargs`` as commands: bad values are exit-2 errors naming the
flag (or variable) before anything starts; good ones land in the server's config values, and
``mmis serve`` hands the revision (only) to its engine child."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from mmis.entrypoints import engine as engine_cli
from mmis.entrypoints import frontend as frontend_cli
from mmis.entrypoints import serve as serve_cli

CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("MMIS_")}


def mmis(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mmis", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**CLEAN_ENV, **(env or {})},
    )


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (
            ["frontend", "--model", "m", "--processor-kwargs", "{bad"],
            {},
            "argument --processor-kwargs: expected a JSON object, got invalid JSON '{bad'",
        ),
        (
            ["frontend", "--model", "m", "--processor-kwargs", "[1, 2]"],
            {},
            "argument --processor-kwargs: expected a JSON object like",
        ),
        (
            ["serve", "--processor-kwargs", "3"],  # refused while parsing: no engine starts
            {},
            "argument --processor-kwargs: expected a JSON object like",
        ),
        (
            ["frontend", "--model", "m"],
            {"MMIS_FRONTEND_PROCESSOR_KWARGS": '"do_normalize"'},
            "MMIS_FRONTEND_PROCESSOR_KWARGS: expected a JSON object like",
        ),
        (
            ["frontend", "--model", "m", "--processor-kwargs", '{"images": [], "text": "x"}'],
            {},
            "--processor-kwargs must not set ['do_sample_frames', 'images', 'return_tensors', "
            "'text', 'video_metadata', 'videos']",
        ),
        (
            ["engine", "--processor-kwargs", "{}"],  # P1 never runs the processor
            {},
            "unrecognized arguments: --processor-kwargs",
        ),
    ],
)
def test_bad_processor_kwargs_exit_2_naming_the_setting(
    args: list[str], env: dict[str, str], message: str
) -> None:
    done = mmis(*args, env=env)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def parse(module: object, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    module.add_arguments(parser)  # type: ignore[attr-defined]
    return parser.parse_args(argv)


def test_good_values_become_config_values(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("MMIS_"):
            monkeypatch.delenv(key)
    kwargs = {"size": {"shortest_edge": 3136}, "do_normalize": False}
    argv = ["--model", "m", "--revision", "v2", "--processor-kwargs", json.dumps(kwargs)]
    settings = frontend_cli.settings_from(parse(frontend_cli, argv))
    assert settings.revision == "v2"
    assert settings.processor_kwargs == kwargs
    engine = engine_cli.config_from_args(parse(engine_cli, ["--revision", "v2"]))
    assert engine.revision == "v2"

    # the environment layer (flags still win)
    monkeypatch.setenv("MMIS_FRONTEND_PROCESSOR_KWARGS", '{"do_normalize": true}')
    monkeypatch.setenv("MMIS_FRONTEND_REVISION", "from-env")
    monkeypatch.setenv("MMIS_ENGINE_REVISION", "from-env")
    settings = frontend_cli.settings_from(parse(frontend_cli, ["--model", "m"]))
    assert settings.processor_kwargs == {"do_normalize": True}
    assert settings.revision == "from-env"
    settings = frontend_cli.settings_from(parse(frontend_cli, argv))
    assert settings.processor_kwargs == kwargs and settings.revision == "v2"
    assert engine_cli.config_from_args(parse(engine_cli, [])).revision == "from-env"


@pytest.mark.parametrize(
    ("argv", "env", "revision"),
    [
        (["--revision", "v2", "--processor-kwargs", '{"do_normalize": false}'], {}, "v2"),
        ([], {"MMIS_FRONTEND_REVISION": "from-env"}, "from-env"),
        ([], {}, None),
    ],
)
def test_serve_forwards_the_revision_to_its_engine(
    argv: list[str], env: dict[str, str], revision: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in list(os.environ):
        if key.startswith("MMIS_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = parse(serve_cli, argv)
    cmd = serve_cli.engine_command(args, serve_cli.frontend_settings(args))
    child = cmd[cmd.index("engine") + 1 :]
    config = engine_cli.config_from_args(parse(engine_cli, child))  # P1's own parser
    assert config.revision == revision
    assert "--processor-kwargs" not in child
