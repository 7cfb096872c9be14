"""`turnrl config show`: every setting with its help; settings that do nothing are named."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import tomllib

from conftest import SMALL_RUN
from turnrl.cli import main
from turnrl.trainer.config import Config, field_help, inert_settings, load_config
from turnrl.trainer.loop import train


def test_show_prints_the_resolved_config_as_toml_with_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["config", "show", "grpo", "--set", "rollout.group_size=4"]) == 0
    out = capsys.readouterr().out
    parsed = tomllib.loads(out)  # the comments are TOML comments: it reads back
    config = load_config("grpo", ["rollout.group_size=4"])
    assert parsed["rollout"]["group_size"] == 4
    assert parsed["algorithm"]["advantage"] == config.algorithm.advantage
    assert parsed["env"]["num_keys"] == config.env.options["num_keys"]
    assert (
        "group_size = 4  # Samples per task (G); advantages compare samples within a group." in out
    )


def test_every_setting_has_help() -> None:
    config = Config()
    sections = [getattr(config, f.name) for f in dataclasses.fields(config)]
    missing = [
        f"{type(obj).__name__}.{f.name}"
        for obj in [config, *(s for s in sections if dataclasses.is_dataclass(s))]
        for f in dataclasses.fields(obj)
        if not dataclasses.is_dataclass(getattr(obj, f.name))
        and f.name not in field_help(type(obj))
    ]
    assert missing == []


def test_a_setting_without_effect_is_named_and_warned_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = load_config("grpo", [*SMALL_RUN, "algorithm.gigpo_omega=0.5", "algorithm.tis_cap=3"])
    messages = inert_settings(config)
    assert messages == [
        "algorithm.gigpo_omega = 0.5 has no effect: it applies only with advantage = 'gigpo'",
        "algorithm.tis_cap = 3.0 has no effect: it applies only with off_policy != 'none'",
    ]
    assert inert_settings(load_config("gigpo", ["algorithm.gigpo_omega=0.5"])) == []
    with caplog.at_level(logging.WARNING):
        train(config, tmp_path, progress=False)
    warned = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    assert warned == [f"warning: {m}" for m in messages]
