"""CISPO, GMPO and SAPO: hand-computed values and gradients, the on-policy identity with the
plain policy gradient, masked slots, a naive loop, shapes."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from conftest import F64, NAN, bools, t
from turnrl.algorithms import (
    cispo_policy_loss,
    clipped_policy_loss,
    gmpo_policy_loss,
    sapo_policy_loss,
    seq_mean_token_mean,
    token_mean,
)


def grad_of(loss_fn: Callable[..., Any], logprobs: Tensor, *args: Any, **kw: Any) -> Tensor:
    """d(reduced loss)/d logprobs, the reduction being the sum of per-token losses."""
    lp = logprobs.clone().requires_grad_()
    loss_fn(lp, *args, **kw).per_token_loss.sum().backward()
    assert lp.grad is not None
    return lp.grad


# --- CISPO ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ratio", "adv", "eps_low", "weight", "clipped"),
    [
        pytest.param(1.5, 1.0, None, 1.28, True, id="above-high-still-learns"),
        pytest.param(0.5, -1.0, None, 0.5, False, id="no-lower-bound"),
        pytest.param(0.5, -1.0, 0.2, 0.8, True, id="lower-bound"),
        pytest.param(1.1, -1.0, None, 1.1, False, id="inside"),
    ],
)
def test_cispo_weights_log_pi_by_the_clipped_detached_ratio(
    ratio: float, adv: float, eps_low: float | None, weight: float, clipped: bool
) -> None:
    logp = -0.5
    lp, old = t([[logp]]), t([[logp - math.log(ratio)]])
    out = cispo_policy_loss(lp, old, t([[adv]]), bools([[True]]), eps_low=eps_low, eps_high=0.28)
    assert out.per_token_loss.item() == pytest.approx(-weight * adv * logp)
    assert out.clipped.item() is clipped
    grad = grad_of(cispo_policy_loss, lp, old, t([[adv]]), bools([[True]]), eps_low=eps_low)
    assert grad.item() == pytest.approx(-weight * adv)  # never 0, unlike PPO's clip
    ppo = grad_of(clipped_policy_loss, lp, old, t([[adv]]), bools([[True]]), eps_high=0.28)
    if clipped and ratio > 1:
        assert ppo.item() == 0.0


# --- GMPO -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("log_ratios", "adv", "loss", "clipped"),
    [
        pytest.param([0.1, -0.05, 0.02, 0.03], 1.0, -math.exp(0.025), [False] * 4, id="inside"),
        pytest.param([0.6, 0.0], 1.0, -math.exp(0.2), [True, False], id="pos-clipped"),
        pytest.param([0.6, 0.0], -1.0, math.exp(0.3), [False, False], id="neg-unclipped"),
        pytest.param([-0.6, 0.0], 1.0, -math.exp(-0.3), [False, False], id="pos-low-kept"),
        pytest.param([-0.6, 0.0], -1.0, math.exp(-0.2), [True, False], id="neg-low-clipped"),
    ],
)
def test_gmpo_clips_log_ratios_pessimistically_then_takes_the_geometric_mean(
    log_ratios: list[float], adv: float, loss: float, clipped: list[bool]
) -> None:
    old = torch.full((1, len(log_ratios)), -1.0, dtype=F64)
    lp = old + t([log_ratios])
    mask = torch.ones_like(old, dtype=torch.bool)
    out = gmpo_policy_loss(lp, old, t([[adv]]), mask)
    torch.testing.assert_close(out.per_token_loss, torch.full_like(old, loss))
    assert out.clipped.tolist() == [clipped]
    assert seq_mean_token_mean(out.per_token_loss, mask).item() == pytest.approx(loss)
    grad = grad_of(gmpo_policy_loss, lp, old, t([[adv]]), mask)
    assert (grad[0] == 0).tolist() == clipped  # a clipped token gets no gradient


# --- SAPO -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("ratio", "adv"), [(1.5, 1.0), (1.5, -1.0), (0.7, 2.0), (1.0, -0.5)])
def test_sapo_gate_and_its_gradient(ratio: float, adv: float) -> None:
    tau = 1.0 if adv > 0 else 1.05
    s = 1 / (1 + math.exp(-tau * (ratio - 1)))
    lp, old = t([[-0.3]]), t([[-0.3 - math.log(ratio)]])
    out = sapo_policy_loss(lp, old, t([[adv]]), bools([[True]]))
    assert out.per_token_loss.item() == pytest.approx(-s * 4 / tau * adv)
    grad = grad_of(sapo_policy_loss, lp, old, t([[adv]]), bools([[True]]))
    assert grad.item() == pytest.approx(-4 * s * (1 - s) * ratio * adv)
    assert not out.clipped.any()


def test_sapo_fades_off_policy_tokens_instead_of_cutting_them() -> None:
    ratios = [1.0, 1.3, 2.0, 4.0]
    old = torch.zeros(1, 4, dtype=F64)
    lp = old + torch.log(t([ratios]))
    grad = grad_of(sapo_policy_loss, lp, old, t([[1.0]]), torch.ones(1, 4, dtype=torch.bool))
    # Relative to the unclipped surrogate's r * A: 1 on-policy, then smoothly less, never 0
    # (PPO's clip at 1.2 gives 0 from r = 1.3 on).
    relative = [-g / r for g, r in zip(grad[0].tolist(), ratios, strict=True)]
    assert relative[0] == pytest.approx(1.0)
    assert all(a > b > 0 for a, b in itertools.pairwise(relative))


# --- Shared properties ----------------------------------------------------------------------

LOSSES = {
    "cispo": (cispo_policy_loss, token_mean),
    "gmpo": (gmpo_policy_loss, seq_mean_token_mean),
    "sapo": (sapo_policy_loss, seq_mean_token_mean),
}


def random_batch(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -2 * torch.rand(4, 6, generator=g, dtype=F64) - 0.1
    lp = old + 0.3 * torch.randn(4, 6, generator=g, dtype=F64)
    adv = torch.randn(4, 1, generator=g, dtype=F64)
    mask = torch.arange(6)[None, :] < torch.tensor([[6], [3], [1], [4]])
    return lp, old, adv, mask


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_on_policy_each_loss_has_the_plain_policy_gradient(name: str) -> None:
    """At r = 1 the gradient is that of -A log pi (PPO's unclipped surrogate) under the
    loss's own reduction."""
    loss_fn, reduce = LOSSES[name]
    lp, _, adv, mask = random_batch(0)

    def grad(fn: Callable[..., Any]) -> Tensor:
        x = lp.clone().requires_grad_()
        reduce(fn(x, lp, adv, mask).per_token_loss, mask).backward()
        assert x.grad is not None
        return x.grad

    torch.testing.assert_close(grad(loss_fn), grad(clipped_policy_loss))


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_poison_in_masked_slots_changes_nothing(name: str) -> None:
    loss_fn, reduce = LOSSES[name]
    lp, old, adv, mask = random_batch(1)
    clean = lp.clone().requires_grad_()
    reduce(loss_fn(clean, old, adv, mask).per_token_loss, mask).backward()
    poisoned_lp = torch.where(mask, lp, NAN).requires_grad_()
    poisoned_old = torch.where(mask, old, math.inf)
    loss = reduce(loss_fn(poisoned_lp, poisoned_old, adv, mask).per_token_loss, mask)
    loss.backward()
    assert poisoned_lp.grad is not None
    assert clean.grad is not None
    assert torch.equal(poisoned_lp.grad, clean.grad)
    assert (poisoned_lp.grad[~mask] == 0).all()
    assert math.isfinite(loss.item())


@pytest.mark.parametrize("seed", range(3))
def test_losses_match_a_naive_loop(seed: int) -> None:
    lp, old, adv, mask = random_batch(seed)
    cispo = cispo_policy_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.28).per_token_loss
    sapo = sapo_policy_loss(lp, old, adv, mask).per_token_loss
    gmpo = gmpo_policy_loss(lp, old, adv, mask).per_token_loss
    for i in range(lp.shape[0]):
        a = adv[i, 0].item()
        sign = math.copysign(1.0, a)
        logs = []
        for j in range(lp.shape[1]):
            if not mask[i, j]:
                assert cispo[i, j] == sapo[i, j] == gmpo[i, j] == 0.0
                continue
            d = (lp[i, j] - old[i, j]).item()
            r = math.exp(d)
            w = min(max(r, 0.8), 1.28)
            assert cispo[i, j].item() == pytest.approx(-w * a * lp[i, j].item())
            tau = 1.0 if a > 0 else 1.05
            assert sapo[i, j].item() == pytest.approx(-4 / tau / (1 + math.exp(-tau * (r - 1))) * a)
            logs.append(sign * min(sign * d, sign * min(max(d, -0.4), 0.4)))
        geo = math.exp(sum(logs) / len(logs))
        assert gmpo[i, mask[i]].tolist() == pytest.approx([-a * geo] * len(logs))


def test_shapes_are_checked() -> None:
    lp, old, adv, mask = random_batch(0)
    with pytest.raises(ValueError, match="advantages must be"):
        gmpo_policy_loss(lp, old, adv.expand_as(lp), mask)  # one advantage per sequence
    for fn in (cispo_policy_loss, sapo_policy_loss, gmpo_policy_loss):
        with pytest.raises(ValueError, match="one \\[B, T\\] shape"):
            fn(lp, old[:, :3], adv, mask)
    with pytest.raises(ValueError, match="temperatures"):
        sapo_policy_loss(lp, old, adv, mask, tau_neg=0.0)
    with pytest.raises(ValueError, match="clip ranges"):
        cispo_policy_loss(lp, old, adv, mask, eps_high=-1.0)
