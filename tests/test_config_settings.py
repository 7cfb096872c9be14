"""Settings from Python, typed: ``load_config(recipe, settings={...})``, ``Config.with_`` and
``turnrl.train(recipe, config={...})`` give the config ``--set`` gives, and refuse what it
refuses with the same message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import turnrl
import turnrl.api
from turnrl.envs import SecretLookup
from turnrl.errors import ConfigError
from turnrl.trainer.config import RECIPES_DIR, Config, RolloutConfig, load_config

SAME = [  # (--set's string, the typed setting)
    ("rollout.max_turns=3", ("rollout.max_turns", 3)),
    ("rollout.temperature=1", ("rollout.temperature", 1)),
    ("algorithm.kl.coef=0.05", ("algorithm.kl.coef", 0.05)),
    ("algorithm.advantage=rloo", ("algorithm.advantage", "rloo")),
    ("algorithm.filter.dynamic_sampling=true", ("algorithm.filter.dynamic_sampling", True)),
    ('model.lora.target_modules=["q_proj"]', ("model.lora.target_modules", ("q_proj",))),
    ("env.num_keys=3", ("env.num_keys", 3)),
    ("steps=7", ("steps", 7)),
]


def test_typed_settings_give_the_config_set_gives() -> None:
    strings = [s for s, _ in SAME]
    typed = dict(t for _, t in SAME)
    expected = load_config("grpo", strings)
    assert expected.rollout.max_turns == 3
    assert expected.env.options["num_keys"] == 3
    assert load_config("grpo", settings=typed) == expected
    assert load_config("grpo").with_(typed) == expected
    assert load_config("grpo").with_(typed) is not load_config("grpo")
    assert load_config("grpo").with_(steps=7).steps == 7
    assert load_config("grpo").with_({"rollout.max_turns": 2}, steps=7) == load_config(
        "grpo", ["rollout.max_turns=2", "steps=7"]
    )


@pytest.mark.parametrize("recipe", sorted(p.stem for p in RECIPES_DIR.glob("*.toml")))
def test_with_nothing_is_the_same_config(recipe: str) -> None:
    config = load_config(recipe)
    assert config.with_() == config


@pytest.mark.parametrize(
    ("string", "key", "value"),
    [
        ("rollout.max_turn=3", "rollout.max_turn", 3),  # unknown: the nearest is named
        ("algorithm.kl_coef=0.1", "algorithm.kl_coef", 0.1),
        ("rollout.group_size=eight", "rollout.group_size", "eight"),  # wrong type
        ("rollout.group_size=1", "rollout.group_size", 1),  # out of range
        ("algorithm.advantage=ppo", "algorithm.advantage", "ppo"),  # not a choice
        ("steps.x=1", "steps.x", 1),  # not a section
        ("model.tiny.hidden_size=1.5", "model.tiny.hidden_size", 1.5),
    ],
)
def test_typed_settings_are_refused_as_set_refuses_them(string: str, key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as by_set:
        load_config("grpo", [string])
    with pytest.raises(ConfigError) as typed:
        load_config("grpo", settings={key: value})
    with pytest.raises(ConfigError) as by_with:
        load_config("grpo").with_({key: value})
    assert str(typed.value) == str(by_set.value) == str(by_with.value)


def test_a_typed_value_is_not_read_as_a_string_would_be() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.max_turns must be int, got '4'"):
        Config().with_({"rollout.max_turns": "4"})
    with pytest.raises(ConfigError, match="a setting is a dotted key"):
        Config().with_({"rollout..max_turns": 4})


def test_a_new_environment_drops_the_old_ones_options_and_a_section_replaces_a_section() -> None:
    assert load_config("grpo").env.options
    assert load_config("grpo").with_({"env.name": "bandit"}).env.options == {}
    config = load_config("grpo").with_({"env.num_keys": 3, "env.name": "bandit"})
    assert config == load_config("grpo", ["env.num_keys=3", "env.name=bandit"])
    assert (config.env.name, config.env.options) == ("bandit", {"num_keys": 3})
    rollout = RolloutConfig(max_turns=2, group_size=4)
    assert Config().with_(rollout=rollout).rollout == rollout


def test_train_takes_typed_settings_on_a_recipe_or_a_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[Config] = []
    monkeypatch.setattr(turnrl.api, "_train_loop", lambda config, *a, **k: ran.append(config))
    env = SecretLookup(num_keys=2, key_pool=2, num_values=12)
    turnrl.train("grpo", env=env, out=tmp_path, config={"rollout.max_turns": 2})
    turnrl.train(load_config("grpo"), env=env, out=tmp_path, config={"rollout.max_turns": 2})
    turnrl.train(load_config("grpo"), env=env, out=tmp_path, overrides=["rollout.max_turns=2"])
    assert [c.rollout.max_turns for c in ran] == [2, 2, 2]
    assert ran[0] == ran[1] == ran[2]
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout\.max_turn'"):
        turnrl.train("grpo", env=env, out=tmp_path, config={"rollout.max_turn": 2})
