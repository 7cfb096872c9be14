"""`turnrl config show`: every setting with its help; settings that do nothing are named."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import tomllib

from conftest import SMALL_RUN
from turnrl.cli import main
from turnrl.errors import ConfigError
from turnrl.trainer.config import Config, RolloutConfig, field_help, inert_settings, load_config
from turnrl.trainer.config.help import HELP
from turnrl.trainer.loop import train

ROOT = Path(__file__).resolve().parent.parent


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
    def missing(obj: object) -> list[str]:
        out = []
        for f in dataclasses.fields(obj):  # type: ignore[arg-type]
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                out += missing(value)
            elif f.name not in field_help(type(obj)):
                out.append(f"{type(obj).__name__}.{f.name}")
        return out

    assert missing(Config()) == []


def test_the_help_table_is_the_docstrings_and_needs_no_source(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = importlib.util.spec_from_file_location("config_help", ROOT / "dev" / "config_help.py")
    assert spec is not None
    assert spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    table = generator.schema_help()
    assert table == HELP, "a docstring changed: run `python dev/config_help.py`"
    assert (ROOT / "src/turnrl/trainer/config/help.py").read_text() == generator.render(table)
    assert main(["config", "show", "dapo"]) == 0
    shown = capsys.readouterr().out

    def no_source(obj: object) -> str:
        raise OSError("no source in this build")

    monkeypatch.setattr(inspect, "getsource", no_source)
    monkeypatch.setattr(inspect, "getsourcelines", no_source)
    assert field_help(RolloutConfig)["max_turns"] == "Model turns per episode."
    assert main(["config", "show", "dapo"]) == 0
    assert capsys.readouterr().out == shown


def test_a_setting_without_effect_is_named_and_warned_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = load_config(
        "grpo", [*SMALL_RUN, "algorithm.gigpo.omega=0.5", "algorithm.off_policy.cap=3"]
    )
    messages = inert_settings(config)
    assert messages == [
        "algorithm.gigpo.omega = 0.5 has no effect: it applies only with advantage = 'gigpo'",
        "algorithm.off_policy.cap = 3.0 has no effect: it applies only with "
        "off_policy.correction != 'none'",
    ]
    assert inert_settings(load_config("gigpo", ["algorithm.gigpo.omega=0.5"])) == []
    with caplog.at_level(logging.WARNING):
        train(config, tmp_path, progress=False)
    warned = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    assert warned == [f"warning: {m}" for m in messages]


def test_sections_nest_and_show_under_their_own_headers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["config", "show", "dapo"]) == 0
    out = capsys.readouterr().out
    parsed = tomllib.loads(out)
    assert parsed["algorithm"]["kl"]["coef"] == 0.1
    assert parsed["algorithm"]["clip"]["high"] == 0.28
    assert parsed["algorithm"]["filter"]["dynamic_sampling"] is True
    assert "[algorithm.kl]  # A KL to the reference policy" in out


def test_an_unknown_key_names_the_nearest_setting_a_sub_section_included(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'algorithm\.kl\.coeff'"):
        load_config(None, ["algorithm.kl.coeff=0.1"])
    with pytest.raises(
        ConfigError, match=r"'algorithm\.kl_coef'; did you mean 'algorithm\.kl\.coef'\?"
    ):
        load_config(None, ["algorithm.kl_coef=0.1"])
    flat = tmp_path / "flat.toml"
    flat.write_text('base = "quickstart"\n[algorithm]\neps_high = 0.28\n')
    with pytest.raises(
        ConfigError, match=r"'algorithm\.eps_high'; did you mean 'algorithm\.clip\.high'\?"
    ):
        load_config(str(flat))
    with pytest.raises(
        ConfigError, match=r"'rollout\.max_turn'; did you mean 'rollout\.max_turns'\?"
    ):
        load_config(None, ["rollout.max_turn=3"])


@pytest.mark.parametrize(
    ("name", "value"),
    [("arch", "llama"), ("hidden_size", 32), ("num_layers", 1), ("num_heads", 2),
     ("vocab_size", 512), ("echo_steps", 3), ("echo_novel", 0.5)],
)  # fmt: skip
def test_a_tiny_model_setting_written_in_model_names_its_key_in_model_tiny(
    name: str, value: Any, tmp_path: Path
) -> None:
    """The tiny model's settings moved from ``model`` to ``model.tiny``, with no alias: the
    old key is unknown, and its error names the new one, from ``--set``, from Python and
    from a recipe."""
    message = rf"unknown config key 'model\.{name}'; did you mean 'model\.tiny\.{name}'\?"
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"model.{name}={json.dumps(value)}"])
    with pytest.raises(ConfigError, match=message):
        Config().with_({f"model.{name}": value})
    old = tmp_path / "old.toml"
    old.write_text(f'base = "quickstart"\n[model]\n{name} = {json.dumps(value)}\n')
    with pytest.raises(ConfigError, match=message):
        load_config(str(old))
    new = load_config(None, [f"model.tiny.{name}={json.dumps(value)}"])
    assert getattr(new.model.tiny, name) == value


def test_the_cluster_section_is_shown_and_bad_values_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["config", "show", "--set", "cluster.learner_ranks=2"]) == 0
    out = capsys.readouterr().out
    assert tomllib.loads(out)["cluster"] == {
        "learner_ranks": 2, "fsdp_unit": "layer", "learner_placement": "local",
        "rollout_workers": 0, "weight_sync": "auto", "worker_timeout_s": 900.0,
        "address": "",
    }  # fmt: skip
    assert "rollout_workers = 0  # Inference engines with their environments: 0 samples" in out
    assert load_config(None, ["cluster.rollout_workers=2"]).cluster.rollout_workers == 2
    warned = inert_settings(load_config(None, ["cluster.address=10.0.0.1:6379"]))
    assert warned == [
        "cluster.address = '10.0.0.1:6379' has no effect: only rollout workers "
        "(cluster.rollout_workers >= 1) and learner ranks placed by Ray "
        "(cluster.learner_placement = 'ray') join a Ray cluster"
    ]
    placed = ["cluster.address=auto", "cluster.learner_ranks=2", "cluster.learner_placement=ray"]
    assert inert_settings(load_config(None, placed)) == []
    assert inert_settings(load_config(None, ["cluster.weight_sync=broadcast"])) == [
        "cluster.weight_sync = 'broadcast' has no effect: it is how the weights reach "
        "rollout workers (cluster.rollout_workers >= 1)"
    ]
    both = ["cluster.weight_sync=broadcast", "cluster.rollout_workers=1"]
    assert inert_settings(load_config(None, both)) == []
    with pytest.raises(ConfigError, match=r"cluster\.weight_sync"):
        load_config(None, ["cluster.weight_sync=nccl"])
    for key in ("learner_ranks", "rollout_workers"):
        with pytest.raises(ConfigError, match=rf"cluster\.{key} must be >= 0"):
            load_config(None, [f"cluster.{key}=-1"])
    with pytest.raises(ConfigError, match=r"cluster\.worker_timeout_s must be > 0"):
        load_config(None, ["cluster.worker_timeout_s=0"])
    with pytest.raises(
        ConfigError, match=r"cluster\.fsdp_unit must be one of \['layer', 'model'\]"
    ):
        load_config(None, ["cluster.fsdp_unit=block"])
    assert load_config(None, ["cluster.fsdp_unit=model"]).cluster.fsdp_unit == "model"
