"""Named presets: one recipe per paper, each loading, validating and training a step."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import SMALL_RUN
from turnrl.errors import ConfigError
from turnrl.trainer.config import RECIPES_DIR, load_config, read_recipe
from turnrl.trainer.loop import train

PRESETS = ["grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "ppo", "gspo", "starpo_s", "gigpo"]


def test_every_preset_has_a_recipe_and_a_section_in_docs() -> None:
    papers = (Path(__file__).resolve().parents[1] / "docs" / "papers.md").read_text()
    for name in PRESETS:
        assert (RECIPES_DIR / f"{name}.toml").is_file(), name
        assert f"`{name}`" in papers, name


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_trains_a_step(tmp_path: Path, name: str) -> None:
    small = [x for x in SMALL_RUN if not x.startswith("rollout.prompts_per_step")]
    config = load_config(name, [*small, "steps=1", "rollout.prompts_per_step=4"])
    assert config.name == name
    result = train(config, tmp_path, progress=False)
    (row,) = [r for r in result.rows if "rollout/reward_mean" in r]
    if "loss/policy" not in row:  # DAPO found no informative group in 3 rounds: no update
        assert name == "dapo"
        assert row["select/groups_kept"] == 0
        assert row["select/sample_rounds"] == 3
        return
    assert math.isfinite(row["loss/policy"])
    assert row["train/logprob_mismatch"] < 1e-4


def test_a_base_recipe_is_merged_section_by_section(tmp_path: Path) -> None:
    (tmp_path / "child.toml").write_text(
        f'base = "{RECIPES_DIR / "quickstart.toml"}"\nname = "child"\n[algorithm]\nlr = 0.5\n'
    )
    merged = read_recipe(str(tmp_path / "child.toml"))
    base = read_recipe("quickstart")
    assert merged["algorithm"]["lr"] == 0.5
    assert merged["algorithm"]["kl"]["coef"] == base["algorithm"]["kl"]["coef"]  # kept from base
    assert merged["env"] == base["env"]
    assert "base" not in merged


def test_a_cycle_of_bases_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text(f'base = "{tmp_path / "b.toml"}"\n')
    (tmp_path / "b.toml").write_text(f'base = "{tmp_path / "a.toml"}"\n')
    with pytest.raises(ConfigError, match="cycle"):
        read_recipe(str(tmp_path / "a.toml"))
    (tmp_path / "c.toml").write_text("base = 3\n")
    with pytest.raises(ConfigError, match="base must be a recipe name"):
        read_recipe(str(tmp_path / "c.toml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_combines_with_another_environment(preset: str) -> None:
    """A preset carries no environment settings of its own: naming another environment
    drops the probe's options (they belong to the probe), and options given beside the new
    name apply to it, in any order."""
    config = load_config(preset, ["env.reward=expected", "env.name=bandit"])
    assert config.env.name == "bandit"
    assert config.env.options == {"reward": "expected"}
    assert config.algorithm == load_config(preset).algorithm


def test_a_preset_trains_on_another_environment(tmp_path: Path) -> None:
    """`turnrl train grpo --set env.name=bandit` used to fail on the probe's options."""
    result = train(load_config("grpo", [*SMALL_RUN, "env.name=bandit"]), tmp_path, progress=False)
    trained = [r for r in result.rows if "loss/policy" in r]
    assert [r["step"] for r in trained] == [1, 2]
    assert json.loads((tmp_path / "config.json").read_text())["env"]["name"] == "bandit"
