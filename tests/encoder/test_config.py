"""``mmis encoder``'s settings are one dataclass (``engine/encoder/config.py``): the flags and
``MMIS_ENCODER_*`` derive from its fields, with no default of their own."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from mmis.config import from_env
from mmis.engine.encoder.config import EncoderConfig
from mmis.entrypoints import encoder as encoder_cli


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    encoder_cli.add_arguments(parser)
    return parser


def test_every_field_is_an_option_without_a_default_of_its_own() -> None:
    actions = [a for a in _parser()._actions if a.dest != "help"]
    assert {a.dest for a in actions} == {f.name for f in dataclasses.fields(EncoderConfig)}
    assert all(a.default is None for a in actions)
    assert from_env(EncoderConfig, "encoder", environ={}) == EncoderConfig()


def test_the_token_comes_from_the_environment_and_bad_values_name_their_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MMIS_ENCODER_TOKEN", "s3cret")
    cfg = encoder_cli.config_from_args(_parser().parse_args(["--max-batch-items", "3"]))
    assert cfg.token == "s3cret" and cfg.max_batch_items == 3
    with pytest.raises(SystemExit, match="mmis encoder: --max-batch-items must be at least 1"):
        encoder_cli.config_from_args(_parser().parse_args(["--max-batch-items", "0"]))
    monkeypatch.setenv("MMIS_ENCODER_TOKEN", "x" * 256)
    with pytest.raises(SystemExit, match="--token must be 1 to 255 bytes") as refused:
        encoder_cli.config_from_args(_parser().parse_args([]))
    assert "xxxx" not in str(refused.value)  # the token is never quoted
