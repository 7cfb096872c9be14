"""Resolving a configuration: the ``auto`` choices made from the other settings, and the
settings that have no effect under the chosen algorithm."""

from __future__ import annotations

import dataclasses
from typing import Any

from turnrl.trainer.config.schema import BANDS, AlgorithmConfig, Config

STARTUP_TOLERANCE = {"float32": 1e-3, "bf16-mixed": 0.1}
"""``rollout.startup_tolerance`` when it is 0, by ``model.precision``."""


def resolved(config: Config) -> Config:
    """``config`` with its ``auto`` choices made: ``rollout.sampler_weights`` is ``bf16``
    under bf16-mixed and ``shared`` otherwise (with the torch backend; vLLM ignores it); ``rollout.startup_tolerance`` 0 becomes
    ``STARTUP_TOLERANCE`` of the sampler's precision; ``algorithm.off_policy.correction``
    is ``token_tis`` under vLLM or a bf16 torch sampler (other numerics) or asynchronous
    training (older weights) and ``none`` otherwise."""
    r = config.rollout
    bf16_mixed = config.model.precision == "bf16-mixed"
    if r.sampler_weights == "auto" and r.backend == "torch":  # vLLM ignores it: kept auto
        r = dataclasses.replace(r, sampler_weights="bf16" if bf16_mixed else "shared")
    bf16_copy = r.backend == "torch" and r.sampler_weights == "bf16"
    if r.startup_tolerance == 0.0:
        precision = "bf16-mixed" if bf16_copy else config.model.precision
        r = dataclasses.replace(r, startup_tolerance=STARTUP_TOLERANCE[precision])
    config = dataclasses.replace(config, rollout=r)
    off = config.algorithm.off_policy
    if off.correction != "auto":
        return config
    other = r.backend == "vllm" or bf16_copy or config.algorithm.max_staleness > 0
    made = dataclasses.replace(off, correction="token_tis" if other else "none")
    algorithm = dataclasses.replace(config.algorithm, off_policy=made)
    return dataclasses.replace(config, algorithm=algorithm)


CAPPED = frozenset({"token_tis", "sequence_tis", "sequence_mask", "token_mis", "sequence_mis"})
"""The corrections that ``algorithm.off_policy.cap`` bounds."""


def _inert_rules(a: AlgorithmConfig) -> list[tuple[str, bool, str]]:
    """(a setting, whether it has an effect under ``a``, when it does)."""
    gae = a.advantage == "gae"
    return [
        ("critic", gae, "advantage = 'gae'"),
        ("gae", gae, "advantage = 'gae'"),
        ("gae.turn_gamma", gae and a.gae.level == "turn", "advantage = 'gae', gae.level = 'turn'"),
        ("gigpo", a.advantage == "gigpo", "advantage = 'gigpo'"),
        ("kl.estimator", a.kl.coef > 0, "kl.coef > 0"),
        ("kl.placement", a.kl.coef > 0, "kl.coef > 0"),
        ("off_policy.cap", a.off_policy.correction != "none", "off_policy.correction != 'none'"),
        ("off_policy.cap", a.off_policy.correction in CAPPED,
         f"off_policy.correction in {sorted(CAPPED)}"),
        ("off_policy.min_ratio", a.off_policy.correction in BANDS,
         f"off_policy.correction in {sorted(BANDS)}"),
        ("off_policy.max_ratio", a.off_policy.correction in BANDS,
         f"off_policy.correction in {sorted(BANDS)}"),
        ("sapo", a.policy_loss == "sapo", "policy_loss = 'sapo'"),
        ("clip.low", a.policy_loss != "sapo", "policy_loss != 'sapo'"),
        ("clip.high", a.policy_loss != "sapo", "policy_loss != 'sapo'"),
        ("filter.max_rounds", a.filter.dynamic_sampling, "filter.dynamic_sampling = true"),
        ("clip.dual", a.policy_loss == "ppo", "policy_loss = 'ppo'"),
        ("partial_rollouts", a.max_staleness > 0, "max_staleness >= 1"),
        ("overlap_batches", a.max_staleness > 1, "max_staleness >= 2"),
        ("teacher.coef", bool(a.teacher.path), "teacher.path set"),
    ]  # fmt: skip


def inert_settings(config: Config) -> list[str]:
    """Settings changed from their defaults that do nothing under the chosen algorithm
    (e.g. ``gigpo.omega`` under GRPO), one message each: a typo or a misunderstanding
    is better caught before the run than after."""
    out: dict[str, str] = {}
    for name, active, when in _inert_rules(resolved(config).algorithm):
        if active:
            continue
        for key, value in _changed(resolved(config).algorithm, AlgorithmConfig(), name):
            out.setdefault(
                key, f"algorithm.{key} = {value!r} has no effect: it applies only with {when}"
            )
    if config.rollout.backend == "vllm" and config.rollout.sampler_weights != "auto":
        out["rollout.sampler_weights"] = (
            f"rollout.sampler_weights = {config.rollout.sampler_weights!r} has no effect: "
            "it applies only with rollout.backend = 'torch' (vLLM holds its own copy)"
        )
    c = config.cluster
    if c.address and c.rollout_workers == 0 and c.learner_placement != "ray":
        out["cluster.address"] = (
            f"cluster.address = {c.address!r} has no effect: only rollout workers "
            "(cluster.rollout_workers >= 1) and learner ranks placed by Ray "
            "(cluster.learner_placement = 'ray') join a Ray cluster"
        )
    if c.weight_sync != "auto" and c.rollout_workers == 0:
        out["cluster.weight_sync"] = (
            f"cluster.weight_sync = {c.weight_sync!r} has no effect: it is how the weights "
            "reach rollout workers (cluster.rollout_workers >= 1)"
        )
    return list(out.values())


def _changed(obj: Any, default: Any, dotted: str) -> list[tuple[str, Any]]:
    """(dotted key, value) of the settings under ``dotted`` that differ from ``default``."""
    value, base = obj, default
    for part in dotted.split("."):
        value, base = getattr(value, part), getattr(base, part)
    if not dataclasses.is_dataclass(value):
        return [(dotted, value)] if value != base else []
    return [
        item
        for f in dataclasses.fields(value)
        for item in _changed(obj, default, f"{dotted}.{f.name}")
    ]
