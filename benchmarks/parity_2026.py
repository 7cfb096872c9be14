"""Parity of the 2026 off-policy masks and losses with verl's own functions.

benchmarks/data/verl_reference_2026.json holds random cases (inputs and outputs) that verl's
own functions produced: verl 0.9.1's ``compute_rollout_correction_weights`` and
``compute_rollout_rejection_mask`` (``verl/trainer/ppo/rollout_corr_helper.py``) and
``compute_policy_loss_cispo``, ``compute_policy_loss_geo_mean`` and
``compute_policy_loss_sapo`` (``verl/trainer/ppo/core_algos.py``), run in float64 on a CPU.
This script runs turnrl's functions on the same inputs and reports the largest absolute
difference per function: the weights (or the kept sequences) on the sampled tokens, the
reduced loss and its gradient with respect to the log-probs, and the masked shares.

    python benchmarks/parity_2026.py           # every case; writes benchmarks/results/parity_2026
    python benchmarks/parity_2026.py --smoke   # the first case of each function

Conventions that differ from verl's are mapped, not hidden (each is listed in the table):
verl's ratio band for rejection (``*_k1``) bounds pi_rollout / pi_old, the reciprocal of
turnrl's rho = pi_old / pi_rollout, so turnrl's band [lo, hi] is verl's "1/hi_1/lo" and
verl's ``fraction_high`` is turnrl's ``masked_low_fraction``; verl writes 0 where nothing is
sampled and turnrl 1 (a weight that multiplies a masked loss either way), so only sampled
tokens are compared.
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from outputs import parse_args
from training_runs import write_results
from turnrl.algorithms import (
    cispo_policy_loss,
    geometric_sequence_mask,
    gmpo_policy_loss,
    icepop_weights,
    sapo_policy_loss,
    seq_mean_token_mean,
    sequence_mis_weights,
    sequence_tis_weights,
    token_mean,
    token_mis_weights,
    token_tis_weights,
)

ROOT = Path(__file__).resolve().parent
REFERENCE = ROOT / "data" / "verl_reference_2026.json"
TOLERANCE = 1e-6
F64 = torch.float64

Inputs = dict[str, Tensor]
Outputs = dict[str, Any]


def _weights(out: Any) -> Outputs:
    return {"weights": out.weights, "metrics": out.metrics}


def _loss(
    loss_fn: Callable[..., Any], reduce: Callable[[Tensor, Tensor], Tensor], per_sequence: bool
) -> Callable[[Inputs, dict[str, Any]], Outputs]:
    """turnrl's loss reduced as verl's, and its gradient with respect to the log-probs."""

    def run(x: Inputs, params: dict[str, Any]) -> Outputs:
        lp = x["logprobs"].clone().requires_grad_()
        mask = x["loss_mask"]
        adv = x["advantages"]
        # A per-sequence advantage is verl's token advantages' mean, as its GMPO takes it.
        adv = (
            (adv * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True) if per_sequence else adv
        )
        kwargs = {k: v for k, v in params.items() if k != "reduction"}
        if loss_fn is cispo_policy_loss and kwargs["eps_low"] >= 1.0:
            kwargs["eps_low"] = None  # verl's 1.0: clip at 0, i.e. no lower bound
        out = loss_fn(lp, x["old_logprobs"], adv, mask, **kwargs)
        loss = reduce(out.per_token_loss, mask)
        loss.backward()
        assert lp.grad is not None
        return {"loss": loss.detach(), "grad": lp.grad}

    return run


TURNRL: dict[str, Callable[[Inputs, dict[str, Any]], Outputs]] = {
    "token_tis_weights": lambda x, p: _weights(
        token_tis_weights(x["old_logprobs"], x["sampler_logprobs"], x["loss_mask"], **p)
    ),
    "sequence_tis_weights": lambda x, p: _weights(
        sequence_tis_weights(x["old_logprobs"], x["sampler_logprobs"], x["loss_mask"], **p)
    ),
    "icepop_weights": lambda x, p: _weights(
        icepop_weights(x["old_logprobs"], x["sampler_logprobs"], x["loss_mask"], **p)
    ),
    "token_mis_weights": lambda x, p: _weights(
        token_mis_weights(x["old_logprobs"], x["sampler_logprobs"], x["loss_mask"], **p)
    ),
    "sequence_mis_weights": lambda x, p: _weights(
        sequence_mis_weights(x["old_logprobs"], x["sampler_logprobs"], x["loss_mask"], **p)
    ),
    "geometric_sequence_mask": lambda x, p: (
        lambda out: {"keep": out.keep[:, None].expand_as(x["loss_mask"]), "metrics": out.metrics}
    )(geometric_sequence_mask(x["old_logprobs"], x["sampler_logprobs"], x["loss_mask"], **p)),
    "cispo_policy_loss": _loss(cispo_policy_loss, token_mean, per_sequence=False),
    "gmpo_policy_loss": _loss(gmpo_policy_loss, seq_mean_token_mean, per_sequence=True),
    "sapo_policy_loss": _loss(sapo_policy_loss, seq_mean_token_mean, per_sequence=False),
}
"""turnrl's side of each function of the reference, by name."""

VERL = {
    "token_tis_weights": "compute_rollout_correction_weights",
    "sequence_tis_weights": "compute_rollout_correction_weights",
    "icepop_weights": "compute_rollout_correction_weights",
    "token_mis_weights": "compute_rollout_correction_weights x compute_rollout_rejection_mask",
    "sequence_mis_weights": "compute_rollout_correction_weights x compute_rollout_rejection_mask",
    "geometric_sequence_mask": "compute_rollout_rejection_mask",
    "cispo_policy_loss": "compute_policy_loss_cispo",
    "gmpo_policy_loss": "compute_policy_loss_geo_mean",
    "sapo_policy_loss": "compute_policy_loss_sapo",
}
"""verl's function(s) each turnrl function is compared with (the call: each case's ``verl``)."""

CONVENTIONS = {
    "token_tis_weights": "weights compared on sampled tokens (verl 0 elsewhere, turnrl 1)",
    "sequence_tis_weights": "as token TIS; turnrl returns [B, 1], broadcast",
    "icepop_weights": "verl's IcePop is rollout_is='token' with a 'lo_hi' threshold",
    "token_mis_weights": (
        "verl: token IS weights x token_k1 rejection; its k1 band bounds 1/rho, so turnrl's "
        "[lo, hi] is verl's '1/hi_1/lo' and verl's fraction_high is turnrl's masked_low"
    ),
    "sequence_mis_weights": (
        "verl's decoupled_seq_is_rs: sequence IS weights x seq_sum_k1 rejection, band reciprocal"
    ),
    "geometric_sequence_mask": "verl's Geo-RS (seq_mean_k1), band reciprocal",
    "cispo_policy_loss": "token-mean loss; verl's clip_ratio_low 1.0 is turnrl's eps_low None",
    "gmpo_policy_loss": (
        "verl's mean over rows is seq_mean_token_mean; its +1e-8 in the token count is the diff"
    ),
    "sapo_policy_loss": (
        "verl reduces SAPO by seq-mean-token-mean whatever loss_agg_mode says; its +1e-8 in the "
        "token count is the diff"
    ),
}


def compare(case: dict[str, Any]) -> dict[str, float]:
    """The largest absolute difference of each compared quantity of one case."""
    x: Inputs = {k: torch.tensor(v, dtype=F64) for k, v in case["inputs"].items()}
    x["loss_mask"] = x["loss_mask"].bool()
    mask = x["loss_mask"]
    ours = TURNRL[case["function"]](x, case["params"])
    theirs = case["outputs"]
    diffs: dict[str, float] = {}
    for key in ("weights", "keep", "grad"):
        if key in theirs:
            mine = ours[key].to(F64).expand_as(mask)
            ref = torch.tensor(theirs[key], dtype=F64)
            diffs[key] = float((mine - ref).abs()[mask].max())
    if "loss" in theirs:
        diffs["loss"] = abs(float(ours["loss"]) - theirs["loss"])
    for name, value in theirs.get("metrics", {}).items():
        diffs[f"metric {name}"] = abs(float(ours["metrics"][name]) - value)
    return diffs


def masked_share(case: dict[str, Any]) -> float | None:
    """The share of sampled tokens verl masked (weight 0 or dropped), where it masks."""
    mask = torch.tensor(case["inputs"]["loss_mask"]).bool()
    out = case["outputs"]
    if case["function"] in {"icepop_weights", "token_mis_weights", "sequence_mis_weights"}:
        return float((torch.tensor(out["weights"])[mask] == 0).double().mean())
    if "keep" in out:
        return float((torch.tensor(out["keep"])[mask] == 0).double().mean())
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args = parse_args(parser, "parity_2026", smoke={})
    reference = json.loads(REFERENCE.read_text())
    cases = reference["cases"]
    if args.smoke:
        firsts: dict[str, dict[str, Any]] = {}
        for case in cases:
            firsts.setdefault(case["function"], case)
        cases = list(firsts.values())
    rows: dict[str, dict[str, Any]] = {}
    for case in cases:
        row = rows.setdefault(
            case["function"],
            {"function": case["function"], "verl": VERL[case["function"]], "cases": 0,
             "max_abs_diff": 0.0, "by_quantity": {}, "masked_share": [],
             "convention": CONVENTIONS[case["function"]]},
        )  # fmt: skip
        row["cases"] += 1
        for key, diff in compare(case).items():
            row["by_quantity"][key] = max(row["by_quantity"].get(key, 0.0), diff)
            row["max_abs_diff"] = max(row["max_abs_diff"], diff)
        share = masked_share(case)
        if share is not None:
            row["masked_share"].append(share)
    runs = list(rows.values())
    meta = {
        "verl": reference["verl"], "tolerance": TOLERANCE, "smoke": args.smoke,
        "torch": torch.__version__, "machine": platform.machine(),
        "all_within_tolerance": all(r["max_abs_diff"] <= TOLERANCE for r in runs),
    }  # fmt: skip
    lines = [
        f"# Parity with verl's own functions (verl {reference['verl'].split()[0]}, "
        f"torch {torch.__version__}, float64)",
        "",
        f"{sum(r['cases'] for r in runs)} random cases (6 sequences x 10 tokens, ragged "
        "masks); verl's outputs were produced by its own functions (`benchmarks/parity_2026.py`"
        " says which) and are stored in `benchmarks/data/verl_reference_2026.json`. Max |diff|"
        " over the sampled tokens of every case: weights or kept sequences, the reduced loss"
        " and its gradient, the masked shares.",
        "",
        "| turnrl | verl | cases | max abs diff | compared | verl masked (per case) | convention |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        compared = ", ".join(f"{k} {v:.1e}" for k, v in r["by_quantity"].items())
        shares = ", ".join(f"{s:.2f}" for s in r["masked_share"]) or "—"
        lines.append(
            f"| `{r['function']}` | {' x '.join(f'`{n}`' for n in r['verl'].split(' x '))} | {r['cases']} | {r['max_abs_diff']:.1e} "
            f"| {compared} | {shares} | {r['convention']} |"
        )
    verdict = "all within" if meta["all_within_tolerance"] else "NOT all within"
    lines += ["", f"Tolerance {TOLERANCE:g}: {verdict}."]
    write_results(args.out, meta, runs, lines)
    print("\n".join(lines))
    if not meta["all_within_tolerance"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
