"""The four loss reductions: hand-computed values, masked slots, padding and permutation, and
the equivalence that matters for training: micro-batches with gradient accumulation and the
global normaliser give exactly the one-batch gradient, for every mode."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

from conftest import F64, NAN, PROPERTY, t
from turnrl.algorithms import (
    clipped_policy_loss,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    token_mean,
)

MAX_LENGTH = 16.0  # L for seq-mean-token-sum-norm: a constant, not the padded width

# Each mode with its normaliser: (reduce(per_token_loss, loss_mask, normaliser or None),
# the global normaliser of a full batch's mask).
Reduce = Callable[[Tensor, Tensor, "float | Tensor | None"], Tensor]
MODES: dict[str, tuple[Reduce, Callable[[Tensor], float | Tensor]]] = {
    "token-mean": (token_mean, lambda mask: mask.sum()),
    "seq-mean-token-mean": (seq_mean_token_mean, lambda mask: mask.any(dim=1).sum()),
    "seq-mean-token-sum": (seq_mean_token_sum, lambda mask: mask.any(dim=1).sum()),
    "seq-mean-token-sum-norm": (
        lambda loss, mask, _: seq_mean_token_sum_norm(loss, mask, MAX_LENGTH),
        lambda mask: MAX_LENGTH,
    ),
}


def test_hand_computed_values_of_every_mode() -> None:
    # Two real sequences (3 and 2 valid tokens) and a row of padding holding junk.
    loss = t([[1.0, 2.0, 6.0], [3.0, NAN, 5.0], [math.inf, NAN, -math.inf]])
    mask = torch.tensor([[True, True, True], [True, False, True], [False, False, False]])
    assert token_mean(loss, mask).item() == pytest.approx(17 / 5)
    assert seq_mean_token_mean(loss, mask).item() == pytest.approx((3 + 4) / 2)
    assert seq_mean_token_sum(loss, mask).item() == pytest.approx((9 + 8) / 2)
    assert seq_mean_token_sum_norm(loss, mask, 10).item() == pytest.approx(17 / 10)
    assert seq_mean_token_mean(loss, mask, num_seqs=7).item() == pytest.approx(7 / 7)
    assert seq_mean_token_sum(loss, mask, num_seqs=torch.tensor(17)).item() == pytest.approx(1.0)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_an_empty_batch_reduces_to_zero_with_a_gradient(mode: str) -> None:
    reduce, _ = MODES[mode]
    loss = t([[1.0, NAN]]).requires_grad_()
    out = reduce(loss, torch.zeros(1, 2, dtype=torch.bool), None)
    assert out.item() == 0.0
    out.backward()
    assert loss.grad is not None
    assert torch.equal(loss.grad, torch.zeros(1, 2, dtype=F64))


def test_reductions_reject_bad_inputs() -> None:
    loss, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="num_seqs"):
        seq_mean_token_mean(loss, mask, num_seqs=-1)
    with pytest.raises(ValueError, match="share one"):
        seq_mean_token_sum(loss, torch.ones(2, 4))
    with pytest.raises(ValueError, match="max_length"):
        seq_mean_token_sum_norm(loss, mask, 0)


@st.composite
def losses_and_masks(draw: st.DrawFn, max_rows: int = 6) -> tuple[Tensor, Tensor]:
    rows, cols = draw(st.integers(1, max_rows)), draw(st.integers(1, 6))
    n = rows * cols
    x = t(draw(st.lists(st.floats(-3, 3), min_size=n, max_size=n))).reshape(rows, cols)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    return x, mask.reshape(rows, cols)


def per_token(x: Tensor) -> Tensor:
    """A nonlinear per-token loss of a leaf, so gradients differ from token to token."""
    return torch.sin(x) * x


POISON = st.sampled_from([math.inf, -math.inf, math.nan, 1e30])


@PROPERTY
@given(batch=losses_and_masks(), mode=st.sampled_from(sorted(MODES)), junk=POISON)
def test_masked_slots_change_nothing_and_get_zero_gradient(
    batch: tuple[Tensor, Tensor], mode: str, junk: float
) -> None:
    x, mask = batch
    reduce, _ = MODES[mode]

    def run(values: Tensor) -> tuple[Tensor, Tensor]:
        # The leaf is the per-token loss itself: a reduction can only guard its own inputs
        # (a NaN made upstream of it is the upstream function's to mask).
        leaf = per_token(values).detach().requires_grad_()
        out = reduce(leaf, mask, None)
        out.backward()
        assert leaf.grad is not None
        return out.detach(), leaf.grad

    value, grad = run(x)
    poisoned_value, poisoned_grad = run(torch.where(mask, x, junk))
    assert torch.equal(poisoned_value, value)
    assert torch.equal(poisoned_grad, grad)
    assert not (grad[~mask] != 0).any()


@PROPERTY
@given(data=st.data(), batch=losses_and_masks(), mode=st.sampled_from(sorted(MODES)), junk=POISON)
def test_padding_and_permutation_change_nothing(
    data: st.DataObject, batch: tuple[Tensor, Tensor], mode: str, junk: float
) -> None:
    x, mask = batch
    reduce, _ = MODES[mode]
    value = reduce(per_token(x), mask, None)
    rows, cols = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
    padded = reduce(
        torch.nn.functional.pad(per_token(x), (0, cols, 0, rows), value=junk),
        torch.nn.functional.pad(mask, (0, cols, 0, rows), value=False),
        None,
    )
    torch.testing.assert_close(padded, value, rtol=1e-12, atol=1e-12)
    perm = data.draw(st.permutations(range(x.shape[0])))
    permuted = reduce(per_token(x[perm]), mask[perm], None)
    torch.testing.assert_close(permuted, value, rtol=1e-12, atol=1e-12)


def accumulate(
    reduce: Reduce, normaliser: float | Tensor | None, x: Tensor, mask: Tensor, cuts: list[int]
) -> tuple[Tensor, Tensor]:
    """Loss summed over micro-batches (split between sequences) and the accumulated gradient,
    one backward per micro-batch as in gradient accumulation."""
    leaf = x.clone().requires_grad_()
    total = torch.zeros((), dtype=F64)
    bounds = [0, *cuts, x.shape[0]]
    for lo, hi in itertools.pairwise(bounds):
        micro = reduce(per_token(leaf[lo:hi]), mask[lo:hi], normaliser)
        micro.backward()
        total = total + micro.detach()
    assert leaf.grad is not None
    return total, leaf.grad


@PROPERTY
@given(data=st.data(), batch=losses_and_masks(), mode=st.sampled_from(sorted(MODES)))
def test_micro_batches_with_the_global_normaliser_match_one_batch(
    data: st.DataObject, batch: tuple[Tensor, Tensor], mode: str
) -> None:
    x, mask = batch
    reduce, global_normaliser = MODES[mode]
    cuts = sorted(data.draw(st.sets(st.integers(1, x.shape[0]), max_size=3)) - {x.shape[0]})
    one_batch, one_grad = accumulate(reduce, None, x, mask, [])
    micro, micro_grad = accumulate(reduce, global_normaliser(mask), x, mask, cuts)
    torch.testing.assert_close(micro, one_batch, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(micro_grad, one_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_per_micro_batch_normalisers_would_not_match(mode: str) -> None:
    # The equivalence test above can fail: normalising each micro-batch by its own count
    # weights the micro-batches equally instead of the tokens or sequences.
    reduce, _ = MODES[mode]
    x = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [0.5, 0.5, 0.5]])
    mask = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    _, one_grad = accumulate(reduce, None, x, mask, [])
    _, local_grad = accumulate(reduce, None, x, mask, [1])
    assert not torch.allclose(local_grad, one_grad)


def test_micro_batched_policy_loss_matches_one_batch_for_every_mode() -> None:
    # End to end with the clipped policy loss, for each mode, on a fixed random batch.
    gen = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(5, 7, generator=gen, dtype=F64) * 3
    old = logprobs + (torch.rand(5, 7, generator=gen, dtype=F64) - 0.5)
    advantages = torch.randn(5, 1, generator=gen, dtype=F64)
    mask = torch.rand(5, 7, generator=gen) > 0.3
    for mode, (reduce, global_normaliser) in MODES.items():
        grads = []
        for cuts, normaliser in (([], None), ([2, 3], global_normaliser(mask))):
            leaf = logprobs.clone().requires_grad_()
            bounds = [0, *cuts, 5]
            for lo, hi in itertools.pairwise(bounds):
                out = clipped_policy_loss(
                    leaf[lo:hi], old[lo:hi], advantages[lo:hi], mask[lo:hi], eps_high=0.28
                )
                reduce(out.per_token_loss, mask[lo:hi], normaliser).backward()
            grads.append(leaf.grad)
        assert grads[0] is not None
        assert grads[1] is not None
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-12, msg=mode)
