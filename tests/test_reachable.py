"""One implementation per algorithm: every exported estimator and loss of
``turnrl.algorithms`` runs in training under some configuration (the trainer calls the
tested functions, not copies of them). Tiny one-step runs cover every choice; a profiler
hook records which functions ran."""

from __future__ import annotations

import inspect
import sys
import threading
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import turnrl.algorithms as algorithms
from conftest import SMALL_RUN
from turnrl.trainer.config import load_config
from turnrl.trainer.loop import train

CONFIGS = [  # together they name every choice of [algorithm] once
    ["algorithm.advantage=grpo", "algorithm.kl.coef=0.1", "algorithm.kl.estimator=k1",
     "algorithm.filter.dynamic_sampling=true", "algorithm.filter.max_rounds=2",
     "algorithm.overlong.filter=true"],
    ["algorithm.advantage=dr_grpo", "algorithm.kl.coef=0.1", "algorithm.kl.estimator=k2",
     "algorithm.loss_reduction=seq_mean_token_sum_norm", "algorithm.overlong.penalty_tokens=8",
     "algorithm.policy_loss=gmpo", "algorithm.off_policy.correction=sequence_mis"],
    ["algorithm.advantage=rloo", "algorithm.kl.coef=0.1", "algorithm.kl.estimator=k3+",
     "algorithm.loss_reduction=seq_mean_token_sum", "algorithm.filter.variance_keep=0.5",
     "algorithm.policy_loss=sapo", "algorithm.off_policy.correction=icepop"],
    ["algorithm.advantage=gigpo", "algorithm.kl.coef=0.1", "algorithm.kl.estimator=k3",
     "algorithm.loss_reduction=seq_mean_token_mean", "algorithm.off_policy.correction=token_tis"],
    ["algorithm.advantage=reinforce_pp", "algorithm.kl.coef=0.1", "algorithm.kl.placement=reward",
     "algorithm.kl.estimator=k1", "algorithm.off_policy.correction=sequence_tis", "algorithm.clip.dual=3"],
    ["algorithm.advantage=reinforce_pp_baseline", "algorithm.policy_loss=gspo",
     "algorithm.off_policy.correction=sequence_mask"],
    ["algorithm.advantage=gae", "algorithm.critic.placement=head",
     "algorithm.off_policy.correction=geometric_mask"],
    ["algorithm.advantage=gae", "algorithm.gae.level=turn", "algorithm.entropy_coef=0.01",
     "algorithm.policy_loss=cispo", "algorithm.off_policy.correction=token_mis"],
    # on-policy distillation: the teacher is the first run's ({runs}: this test's directory)
    ["algorithm.teacher.path={runs}/0", "algorithm.teacher.alone=true"],
]  # fmt: skip

HELPERS = {  # exported for users and tests; not a choice the trainer makes
    "masked_sum": "a reduction primitive",
    "clip_fraction": "a metric helper; the learner reads the loss output's clip mask",
    "policy_ratio": "inside the PPO loss",
    "sequence_ratio": "inside GSPO",
    "entropy_from_logits": "the learner computes entropy with its log-probs (forward.py)",
    "turn_end_mask": "a turn helper for users; turns come from trajectories here",
    "turn_index": "a turn helper for users; turns come from trajectories here",
    "turn_values_to_tokens": "GiGPO's turn values are spread over Trajectory.samples "
    "(credit.token_advantages), which keeps turns with no sampled token",
    "overlong_filter_mask": "the trainer leaves truncated trajectories out of the batch",
    "group_reward_std": "a monitor statistic (rollout metrics)",
    "zero_variance_groups": "a monitor statistic, and inside informative_groups",
}


def test_every_exported_estimator_and_loss_runs_under_some_configuration(tmp_path: Path) -> None:
    functions = {
        name: obj.__code__
        for name in algorithms.__all__
        if inspect.isfunction(obj := getattr(algorithms, name)) and name not in HELPERS
    }
    ran: set[CodeType] = set()

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event == "call":
            ran.add(frame.f_code)

    for i, options in enumerate(CONFIGS):
        options = [o.format(runs=tmp_path) for o in options]
        config = load_config("quickstart", [*SMALL_RUN, "steps=1", *options])
        sys.setprofile(profile)
        threading.setprofile(profile)  # the rollout's program runs on the engine's helper thread
        try:
            train(config, tmp_path / str(i), progress=False)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
    unreached = sorted(name for name, code in functions.items() if code not in ran)
    assert unreached == []
    assert set(HELPERS) <= set(algorithms.__all__)  # the exemptions name real exports
