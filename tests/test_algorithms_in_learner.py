"""The 2026 masks and losses in the learner: chosen by ``algorithm.off_policy.correction`` and
``algorithm.policy_loss``, their metrics the whole batch's whatever the micro-batches, their
gradient accumulated exactly, composable with every advantage estimator; the presets
``cispo``, ``gmpo`` and ``sapo`` train two steps and are in docs/papers.md.

Float comparisons across micro-batch sizes hold to a tolerance set by the scale of the
quantity (docs/testing.md), never to one CPU's round-off."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Any, get_args, get_type_hints

import pytest
import torch

from conftest import SMALL_RUN
from test_learner import algo, grads_after_step, rollout_batch, skewed
from test_presets import PRESETS
from turnrl.errors import ConfigError
from turnrl.rollout.batch import Batch
from turnrl.trainer.config import (
    BANDS,
    RECIPES_DIR,
    AlgorithmConfig,
    OffPolicyConfig,
    load_config,
)
from turnrl.trainer.learner import CORRECTIONS, POLICY_LOSSES, Learner
from turnrl.trainer.loop import train

MASKS = ["token_mis", "sequence_mis", "icepop", "geometric_mask"]
LOSSES = ["cispo", "gmpo", "sapo"]
NEW_PRESETS = ["cispo", "gmpo", "sapo"]
NOT_PRESETS = {"quickstart", "bandit", "frozen_lake", "search_qa", "learning_proof",
               "smollm2_search_qa", "smollm2_tool_math", "demo"}  # fmt: skip
"""Recipes that are environments, models or measurements, not a paper's algorithm (the
SmolLM2 recipes are trained by benchmarks/real_model.py, whose smoke test runs both)."""

BAND = {"icepop": {"off_policy__max_ratio": 1.5}}
"""icepop's own band [0.5, 5] holds every ratio of the skewed batch (at most e^1): a tighter
top so that something is masked."""


def test_every_correction_and_loss_of_the_config_has_an_implementation() -> None:
    corrections = get_args(get_type_hints(OffPolicyConfig)["correction"])
    losses = get_args(get_type_hints(AlgorithmConfig)["policy_loss"])
    assert set(MASKS) <= set(CORRECTIONS) == set(corrections)
    assert set(LOSSES) <= set(POLICY_LOSSES) == set(losses)
    assert set(BANDS) == set(MASKS)


@pytest.mark.parametrize("correction", MASKS)
def test_mask_metrics_are_the_whole_batch_s_whatever_the_micro_batches(
    model: Any, tokenizer: Any, correction: str
) -> None:
    """As tests/test_learner.py's test for TIS: one micro-batch of every row, or one row
    each plus a row with no sampled token, give the same metrics to a tolerance set by each
    metric family's scale; the masked share is a real share (something masked, something
    kept), named by reason."""
    batch = skewed(rollout_batch(model, tokenizer, tasks=2, group=3), shift=0.2)
    dead = Batch(
        batch.input_ids[:1], batch.attention_mask[:1], torch.zeros_like(batch.loss_mask[:1]),
        batch.old_logprobs[:1], batch.advantages[:1],
    )  # fmt: skip
    got = {}
    for size in (64, 1):
        settings = {"off_policy__correction": correction, "micro_batch__size": size}
        learner = Learner(
            copy.deepcopy(model), algo(**settings, **BAND.get(correction, {})), temperature=1.0
        )
        rows = [batch.select(slice(i, i + size)) for i in range(0, batch.num_sequences, size)]
        got[size] = learner.step([*rows, dead] if size == 1 else rows)
    keys = [k for k in got[64] if k.startswith("off_policy/")]
    assert any(k.endswith("_max") for k in keys)
    assert any(k.endswith("_min") for k in keys)
    masked = [k for k in keys if "masked_" in k and k.endswith("_fraction")]
    assert any("_high_" in k for k in masked)
    assert any("_low_" in k for k in masked)

    def family_scale(key: str) -> float:
        stem = re.sub(r"_(min|max|mean)$", "", key)
        return max(1.0, *(abs(got[64][k]) for k in keys if k.startswith(stem)))

    for key in keys:
        assert got[1][key] == pytest.approx(got[64][key], rel=0, abs=1e-5 * family_scale(key))
    (total,) = [k for k in masked if k.endswith("_masked_fraction")]
    high, low = total.replace("masked_", "masked_high_"), total.replace("masked_", "masked_low_")
    assert 0.0 < got[64][total] < 1.0, total
    assert got[64][total] == pytest.approx(got[64][high] + got[64][low], abs=1e-6)
    # Row i's log-ratio is i * 0.2 per token, so only the top of the band is crossed.
    assert got[64][low] == 0.0


@pytest.mark.parametrize(
    "options",
    [
        {"policy_loss": "cispo", "clip__low": 1.0, "clip__high": 0.28},
        {"policy_loss": "gmpo", "clip__low": 0.4, "clip__high": 0.4, "epochs": 2},
        *({"off_policy__correction": name, **BAND.get(name, {})} for name in MASKS),
        {"policy_loss": "sapo", "off_policy__correction": "icepop"},
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)
def test_the_new_options_accumulate_exactly_over_micro_batches(
    model: Any, tokenizer: Any, options: dict[str, Any]
) -> None:
    batch = skewed(rollout_batch(model, tokenizer, tasks=2, group=3), shift=0.1)
    whole = grads_after_step(copy.deepcopy(model), batch, micro_batch_size=64, **options)
    pieces = grads_after_step(copy.deepcopy(model), batch, micro_batch_size=1, **options)
    scale = max(float(g.abs().max()) for g in whole.values())
    assert scale > 0
    for name in whole:
        torch.testing.assert_close(pieces[name], whole[name], rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "gigpo", "gae"])
def test_every_estimator_composes_with_the_new_losses_and_masks(advantage: str) -> None:
    """No option excludes another: every estimator validates with every new loss and
    mask, and the learner takes per-sequence ([B]) and per-token ([B, T], GAE's and
    REINFORCE++'s) advantages under each."""
    for loss in ["ppo", *LOSSES]:
        for correction in ["none", *MASKS]:
            config = load_config(
                "quickstart",
                [f"algorithm.advantage={advantage}", f"algorithm.policy_loss={loss}",
                 f"algorithm.off_policy.correction={correction}"],
            )  # fmt: skip
            assert config.algorithm.policy_loss == loss


@pytest.mark.parametrize(
    ("loss", "correction"), [*zip(LOSSES, MASKS, strict=False), ("ppo", "geometric_mask")]
)
def test_per_token_advantages_step_under_each_loss_and_mask(
    model: Any, tokenizer: Any, loss: str, correction: str
) -> None:
    batch = skewed(rollout_batch(model, tokenizer, tasks=1, group=2), shift=0.05)
    per_token = torch.where(batch.loss_mask, torch.linspace(-1, 1, batch.loss_mask.shape[1]), 0.0)
    batch = Batch(batch.input_ids, batch.attention_mask, batch.loss_mask, batch.old_logprobs,
                  per_token)  # fmt: skip
    config = algo(policy_loss=loss, off_policy__correction=correction, **BAND.get(correction, {}))
    metrics = Learner(copy.deepcopy(model), config, temperature=1.0).step(batch)
    assert math.isfinite(metrics["loss/policy"])
    assert math.isfinite(metrics["train/grad_norm"])


def test_a_band_is_validated_and_each_mask_has_its_own() -> None:
    def band(*overrides: str) -> tuple[float | None, float]:
        return load_config("quickstart", list(overrides)).algorithm.off_policy.band

    assert band("algorithm.off_policy.correction=icepop") == (0.5, 5.0)
    assert band("algorithm.off_policy.correction=geometric_mask") == (0.999, 1.001)
    assert band("algorithm.off_policy.correction=token_mis", "algorithm.off_policy.cap=3") == (
        None,
        3.0,
    )
    assert band(
        "algorithm.off_policy.correction=sequence_mis", "algorithm.off_policy.min_ratio=0.5"
    ) == (0.5, 2.0)
    with pytest.raises(ConfigError, match="min_ratio must be <= max_ratio"):
        band("algorithm.off_policy.correction=icepop", "algorithm.off_policy.min_ratio=6")
    with pytest.raises(ConfigError, match=r"clip\.dual applies to the ppo"):
        load_config("cispo", ["algorithm.clip.dual=3"])


# --- Presets --------------------------------------------------------------------------------


def test_every_recipe_is_a_listed_preset_or_an_environment() -> None:
    """A new paper preset is trained by the preset tests (tests/test_presets.py, or here)."""
    recipes = {p.stem for p in RECIPES_DIR.glob("*.toml")}
    assert recipes == {*PRESETS, *NEW_PRESETS, *NOT_PRESETS}


def test_the_new_presets_are_in_docs_and_say_what_their_paper_chose() -> None:
    papers = (Path(__file__).resolve().parents[1] / "docs" / "papers.md").read_text()
    for name in NEW_PRESETS:
        assert f"`{name}`" in papers, name
        assert "arXiv:" in (RECIPES_DIR / f"{name}.toml").read_text(), name
    cispo, gmpo, sapo = (load_config(n).algorithm for n in NEW_PRESETS)
    assert (cispo.policy_loss, cispo.clip.low, cispo.loss_reduction) == ("cispo", 1.0, "token_mean")
    assert (gmpo.policy_loss, gmpo.clip.low, gmpo.clip.high) == ("gmpo", 0.4, 0.4)
    assert gmpo.loss_reduction == sapo.loss_reduction == "seq_mean_token_mean"
    assert (sapo.policy_loss, sapo.sapo.tau_pos, sapo.sapo.tau_neg) == ("sapo", 1.0, 1.05)


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_each_new_preset_trains_two_steps(tmp_path: Path, name: str) -> None:
    config = load_config(name, [*SMALL_RUN, "steps=2"])
    assert config.name == name
    result = train(config, tmp_path, progress=False)
    trained = [r for r in result.rows if "loss/policy" in r]
    assert [r["step"] for r in trained] == [1, 2]
    for row in trained:
        assert math.isfinite(row["loss/policy"])
        assert row["train/logprob_mismatch"] < 1e-4
