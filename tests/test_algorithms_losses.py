"""GSPO, the clipped value loss, entropy from logits and the KL estimators: docs/algorithms.md
vectors, one test per branch of each clip/min/max, naive loops, and hypothesis properties
(masked slots change nothing and get exactly zero gradient, padding and permutation, the
on-policy identity)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

from conftest import F64, NAN, PROPERTY, bools, t
from turnrl.algorithms import (
    KL_ESTIMATORS,
    clip_fraction,
    clipped_value_loss,
    entropy_from_logits,
    gspo_policy_loss,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_k3_plus,
    seq_mean_token_mean,
    sequence_ratio,
    token_mean,
)

POISON = st.sampled_from([math.inf, -math.inf, math.nan, 1e30, -1e30])


@contextmanager
def nan_checks() -> Iterator[None]:
    """Anomaly mode: raise if any backward step yields NaN, even one blocked further back."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "anomaly detection enabled"
        with torch.autograd.detect_anomaly(check_nan=True):
            yield


def floats(draw: st.DrawFn, lo: float, hi: float, rows: int, cols: int) -> Tensor:
    n = rows * cols
    return t(draw(st.lists(st.floats(lo, hi), min_size=n, max_size=n))).reshape(rows, cols)


def masks(draw: st.DrawFn, rows: int, cols: int) -> Tensor:
    n = rows * cols
    return torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n))).reshape(rows, cols)


# --- GSPO -------------------------------------------------------------------------------


def test_gspo_sequence_ratio_vector() -> None:
    log_ratios = t([[0.1, -0.05, 0.02, 0.03, NAN]])
    old = t([[-1.0, -2.0, -0.5, -3.0, math.inf]])
    mask = bools([[True, True, True, True, False]])
    s = sequence_ratio(old + log_ratios, old, mask)
    assert s.item() == pytest.approx(1.025315, abs=1e-6)
    assert s.item() == pytest.approx(math.exp(0.025), rel=1e-12)


def gspo_at(mean_log_ratio: float, advantage: float) -> tuple[float, bool, float]:
    """Loss, clip flag and d loss / d (each token's logprob) of a 2-token sequence."""
    old = t([[-1.0, -2.0]])
    logprobs = (old + t([[mean_log_ratio + 0.01, mean_log_ratio - 0.01]])).requires_grad_()
    out = gspo_policy_loss(logprobs, old, t([[advantage]]), torch.ones(1, 2, dtype=torch.bool))
    loss = seq_mean_token_mean(out.per_token_loss, torch.ones(1, 2))
    loss.backward()
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad[0, 0], logprobs.grad[0, 1])
    return loss.item(), bool(out.clipped[0, 0]), float(logprobs.grad[0, 0])


S_HIGH = math.log(1.001)  # s = 1.001 > 1 + 4e-4
S_LOW = math.log(0.999)  # s = 0.999 < 1 - 3e-4
S_IN = math.log(1.0001)  # inside [1 - 3e-4, 1 + 4e-4]


@pytest.mark.parametrize(
    ("log_s", "advantage", "loss", "clipped"),
    [
        # A > 0, s above 1 + eps_high: the clipped term wins, no gradient.
        pytest.param(S_HIGH, 1.0, -(1 + 4e-4), True, id="pos-adv-high-ratio-clipped"),
        # A > 0, s below 1 - eps_low: min picks s A (unclipped).
        pytest.param(S_LOW, 1.0, -0.999, False, id="pos-adv-low-ratio-unclipped"),
        # A < 0, s above 1 + eps_high: min picks s A (unclipped).
        pytest.param(S_HIGH, -1.0, 1.001, False, id="neg-adv-high-ratio-unclipped"),
        # A < 0, s below 1 - eps_low: the clipped term wins.
        pytest.param(S_LOW, -1.0, 1 - 3e-4, True, id="neg-adv-low-ratio-clipped"),
        # Inside the range: both terms agree.
        pytest.param(S_IN, 2.0, -2.0002, False, id="inside"),
    ],
)
def test_gspo_clip_branches(log_s: float, advantage: float, loss: float, clipped: bool) -> None:
    value, was_clipped, grad = gspo_at(log_s, advantage)
    assert value == pytest.approx(loss, rel=1e-9)
    assert was_clipped == clipped
    # Unclipped: d(-s A)/d logp_t = -A s / |y| for each of the |y| = 2 tokens.
    expected_grad = 0.0 if clipped else -advantage * math.exp(log_s) / 2
    assert grad == pytest.approx(expected_grad, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"advantages": torch.zeros(2, 3)}, r"\[B, 1\]"),
        ({"advantages": torch.zeros(2)}, r"\[B, 1\]"),
        ({"old_logprobs": torch.zeros(2, 4)}, "share"),
        ({"logprobs": torch.zeros(6), "old_logprobs": torch.zeros(6)}, r"\[B, T\]"),
        ({"eps_high": -0.1}, "clip ranges"),
    ],
)
def test_gspo_rejects_bad_inputs(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "logprobs": torch.zeros(2, 3),
        "old_logprobs": torch.zeros(2, 3),
        "advantages": torch.zeros(2, 1),
        "loss_mask": torch.ones(2, 3),
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        gspo_policy_loss(**args)  # type: ignore[arg-type]


@st.composite
def gspo_batches(draw: st.DrawFn) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    logprobs = floats(draw, -4.0, 0.0, rows, cols)
    # Mean log-ratios of a few 1e-4 reach past both of GSPO's tiny clip boundaries.
    old = logprobs - floats(draw, -2e-3, 2e-3, rows, cols)
    advantages = floats(draw, -2.0, 2.0, rows, 1)
    return logprobs, old, advantages, masks(draw, rows, cols)


def naive_gspo(
    logprobs: Tensor, old: Tensor, advantages: Tensor, mask: Tensor
) -> list[list[float]]:
    rows = []
    for lp, o, a, m in zip(
        logprobs.tolist(), old.tolist(), advantages.tolist(), mask.tolist(), strict=True
    ):
        diffs = [x - y for x, y, v in zip(lp, o, m, strict=True) if v]
        s = math.exp(sum(diffs) / len(diffs)) if diffs else 1.0
        loss = -min(s * a[0], min(max(s, 1 - 3e-4), 1 + 4e-4) * a[0])
        rows.append([loss if v else 0.0 for v in m])
    return rows


@PROPERTY
@given(batch=gspo_batches())
def test_gspo_matches_naive_loop(batch: tuple[Tensor, Tensor, Tensor, Tensor]) -> None:
    logprobs, old, advantages, mask = batch
    out = gspo_policy_loss(logprobs, old, advantages, mask)
    torch.testing.assert_close(out.per_token_loss, t(naive_gspo(logprobs, old, advantages, mask)))


@PROPERTY
@given(batch=gspo_batches(), a=POISON, b=POISON, c=POISON)
def test_gspo_masked_slots_change_nothing_and_get_zero_gradient(
    batch: tuple[Tensor, Tensor, Tensor, Tensor], a: float, b: float, c: float
) -> None:
    logprobs, old, advantages, mask = batch

    def run(lp: Tensor, o: Tensor, adv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        leaf = lp.clone().requires_grad_()
        out = gspo_policy_loss(leaf, o, adv, mask)
        loss = seq_mean_token_mean(out.per_token_loss, mask)
        loss.backward()
        assert leaf.grad is not None
        return out.per_token_loss.detach(), loss.detach(), leaf.grad

    clean = run(logprobs, old, advantages)
    with nan_checks():
        poisoned = run(
            torch.where(mask, logprobs, a),
            torch.where(mask, old, b),
            torch.where(mask.any(dim=1, keepdim=True), advantages, c),
        )
    for x, y in zip(clean, poisoned, strict=True):
        assert torch.equal(x, y)
    assert not (clean[2][~mask] != 0).any()


@PROPERTY
@given(data=st.data(), batch=gspo_batches(), junk=POISON)
def test_gspo_padding_and_permutation_change_nothing(
    data: st.DataObject, batch: tuple[Tensor, Tensor, Tensor, Tensor], junk: float
) -> None:
    logprobs, old, advantages, mask = batch
    rows, cols = data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2))

    def pad(x: Tensor, value: float | bool) -> Tensor:
        return torch.nn.functional.pad(x, (0, 0 if x.shape[1] == 1 else cols, 0, rows), value=value)

    out = gspo_policy_loss(logprobs, old, advantages, mask)
    total = seq_mean_token_mean(out.per_token_loss, mask)
    padded_mask = pad(mask, False)
    padded = gspo_policy_loss(
        pad(logprobs, junk), pad(old, junk), pad(advantages, junk), padded_mask
    )
    num_rows, num_cols = mask.shape
    # Padded rows are longer, so their sums may associate differently: rounding only.
    torch.testing.assert_close(
        padded.per_token_loss[:num_rows, :num_cols], out.per_token_loss, rtol=1e-12, atol=1e-12
    )
    padded_total = seq_mean_token_mean(padded.per_token_loss, padded_mask)
    torch.testing.assert_close(padded_total, total, rtol=1e-12, atol=1e-12)
    perm = data.draw(st.permutations(range(num_rows)))
    permuted = gspo_policy_loss(logprobs[perm], old[perm], advantages[perm], mask[perm])
    assert torch.equal(permuted.per_token_loss, out.per_token_loss[perm])
    torch.testing.assert_close(seq_mean_token_mean(permuted.per_token_loss, mask[perm]), total)


@PROPERTY
@given(batch=gspo_batches())
def test_gspo_on_policy_is_the_sequence_policy_gradient(
    batch: tuple[Tensor, Tensor, Tensor, Tensor],
) -> None:
    logprobs, _, advantages, mask = batch
    out = gspo_policy_loss(logprobs, logprobs, advantages, mask)
    assert torch.equal(out.ratio, torch.ones_like(logprobs))
    assert torch.equal(out.per_token_loss, torch.where(mask, -advantages, 0.0))
    assert clip_fraction(out, mask).item() == 0.0


# --- Value loss -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "target", "loss", "clipped"),
    [
        # Inside V_old +- 0.2: both errors agree, the gradient is V - R.
        pytest.param(1.1, 2.0, 0.405, False, id="inside"),
        # Above the range, the clipped error is larger: max picks it, no gradient.
        pytest.param(1.5, 1.6, 0.08, True, id="above-clipped-wins"),
        # Above the range, the unclipped error is larger: max picks it.
        pytest.param(1.5, 0.0, 1.125, False, id="above-unclipped-wins"),
        # Below the range, the clipped error is larger.
        pytest.param(0.5, 0.4, 0.08, True, id="below-clipped-wins"),
        # Below the range, the unclipped error is larger.
        pytest.param(0.5, 0.9, 0.08, False, id="below-unclipped-wins"),
    ],
)
def test_value_loss_branches(value: float, target: float, loss: float, clipped: bool) -> None:
    values = t([[value]]).requires_grad_()
    out = clipped_value_loss(values, t([[1.0]]), t([[target]]), bools([[True]]), clip_range=0.2)
    torch.testing.assert_close(out.per_token_loss, t([[loss]]))
    assert out.clipped.tolist() == [[clipped]]
    out.per_token_loss.sum().backward()
    assert values.grad is not None
    expected_grad = 0.0 if clipped else value - target
    torch.testing.assert_close(values.grad, t([[expected_grad]]))


def test_value_loss_without_clip_is_half_squared_error() -> None:
    out = clipped_value_loss(
        t([[3.0, 0.0]]), t([[0.0, NAN]]), t([[1.0, NAN]]), bools([[True, False]]), clip_range=None
    )
    assert torch.equal(out.per_token_loss, t([[2.0, 0.0]]))
    assert not out.clipped.any()


def test_value_loss_clip_fraction() -> None:
    out = clipped_value_loss(
        t([[1.5, 1.1, 9.0]]),
        t([[1.0, 1.0, 1.0]]),
        t([[1.6, 2.0, 9.0]]),
        bools([[True, True, False]]),
        clip_range=0.2,
    )
    assert clip_fraction(out, bools([[True, True, False]])).item() == 0.5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"returns": torch.zeros(2, 4)}, "share one"),
        ({"loss_mask": torch.ones(2)}, "loss_mask"),
        ({"clip_range": -0.1}, "clip_range"),
    ],
)
def test_value_loss_rejects_bad_inputs(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "values": torch.zeros(2, 3),
        "old_values": torch.zeros(2, 3),
        "returns": torch.zeros(2, 3),
        "loss_mask": torch.ones(2, 3),
        "clip_range": 0.2,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        clipped_value_loss(**args)  # type: ignore[arg-type]


@PROPERTY
@given(data=st.data(), a=POISON, b=POISON, c=POISON, clip_range=st.sampled_from([None, 0.2, 0.5]))
def test_value_loss_matches_naive_loop_and_ignores_masked_slots(
    data: st.DataObject, a: float, b: float, c: float, clip_range: float | None
) -> None:
    rows, cols = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 5))
    values = floats(data.draw, -2, 2, rows, cols)
    old_values = values + floats(data.draw, -1, 1, rows, cols)
    returns = floats(data.draw, -2, 2, rows, cols)
    mask = masks(data.draw, rows, cols)
    expected = []
    for v_row, o_row, r_row, m_row in zip(
        values.tolist(), old_values.tolist(), returns.tolist(), mask.tolist(), strict=True
    ):
        row = []
        for v, o, r, m in zip(v_row, o_row, r_row, m_row, strict=True):
            loss = 0.5 * (v - r) ** 2
            if clip_range is not None:
                clipped = min(max(v, o - clip_range), o + clip_range)
                loss = max(loss, 0.5 * (clipped - r) ** 2)
            row.append(loss if m else 0.0)
        expected.append(row)

    def run(v: Tensor, o: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
        leaf = v.clone().requires_grad_()
        out = clipped_value_loss(leaf, o, r, mask, clip_range=clip_range)
        token_mean(out.per_token_loss, mask).backward()
        assert leaf.grad is not None
        return out.per_token_loss.detach(), leaf.grad

    clean = run(values, old_values, returns)
    torch.testing.assert_close(clean[0], t(expected))
    with nan_checks():
        poisoned = run(
            torch.where(mask, values, a),
            torch.where(mask, old_values, b),
            torch.where(mask, returns, c),
        )
    assert torch.equal(poisoned[0], clean[0])
    assert torch.equal(poisoned[1], clean[1])
    assert not (clean[1][~mask] != 0).any()


# --- Entropy ----------------------------------------------------------------------------


def test_entropy_of_uniform_and_one_hot_distributions() -> None:
    logits = t([[[0.0, 0.0, 0.0, 0.0], [5.0, -math.inf, -math.inf, -math.inf]]]).requires_grad_()
    out = entropy_from_logits(logits)
    torch.testing.assert_close(out, t([[math.log(4), 0.0]]))
    with nan_checks():
        out.sum().backward()
    assert logits.grad is not None
    assert torch.isfinite(logits.grad).all()


def test_entropy_masks_positions_whatever_their_logits() -> None:
    logits = t([[[1.0, 2.0], [NAN, math.inf]]]).requires_grad_()
    mask = bools([[True, False]])
    out = entropy_from_logits(logits, mask)
    p = torch.softmax(t([1.0, 2.0]), dim=0)
    torch.testing.assert_close(out, t([[float(-(p * p.log()).sum()), 0.0]]))
    with nan_checks():
        out.sum().backward()
    assert logits.grad is not None
    assert torch.equal(logits.grad[0, 1], torch.zeros(2, dtype=F64))
    with pytest.raises(ValueError, match="loss_mask"):
        entropy_from_logits(logits, bools([True, False]))


@PROPERTY
@given(data=st.data())
def test_entropy_matches_categorical(data: st.DataObject) -> None:
    rows, cols, vocab = (
        data.draw(st.integers(1, 3)),
        data.draw(st.integers(1, 4)),
        data.draw(st.integers(1, 6)),
    )
    logits = floats(data.draw, -5, 5, rows * cols, vocab).reshape(rows, cols, vocab)
    mask = masks(data.draw, rows, cols)
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits, mask), torch.where(mask, expected, 0.0))


# --- KL estimators ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pi_theta", "pi_ref", "k1", "k2", "k3"),
    [
        (0.5, 0.25, 0.693147, 0.240227, 0.193147),
        (0.25, 0.5, -0.693147, 0.240227, 0.306853),
    ],
)
def test_kl_vectors(pi_theta: float, pi_ref: float, k1: float, k2: float, k3: float) -> None:
    logp, ref = t([[math.log(pi_theta)]]), t([[math.log(pi_ref)]])
    mask = bools([[True]])
    assert kl_k1(logp, ref, mask).item() == pytest.approx(k1, abs=1e-6)
    assert kl_k2(logp, ref, mask).item() == pytest.approx(k2, abs=1e-6)
    assert kl_k3(logp, ref, mask).item() == pytest.approx(k3, abs=1e-6)
    assert kl_k3_plus(logp, ref, mask).item() == pytest.approx(k3, abs=1e-6)


def test_kl_k3_is_not_negative_for_tiny_log_ratios() -> None:
    # exp(d) - 1 - d would give -1e-197 here; expm1(d) - d gives 0.
    out = kl_k3(t([[0.0, 0.0]]), t([[1e-197, -1e-17]]), bools([[True, True]]))
    assert (out >= 0).all()


def test_kl_estimators_by_name() -> None:
    assert dict(KL_ESTIMATORS) == {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3, "k3+": kl_k3_plus}


def kl_grad(
    estimator: Callable[[Tensor, Tensor, Tensor], Tensor], logp: Tensor, ref: Tensor, mask: Tensor
) -> Tensor:
    leaf = logp.clone().requires_grad_()
    estimator(leaf, ref, mask).sum().backward()
    assert leaf.grad is not None
    return leaf.grad


def test_kl_k3_plus_has_k3_value_and_k2_gradient() -> None:
    logp, ref, mask = t([[-1.0, -0.2, -3.0]]), t([[-0.4, -1.7, -3.0]]), bools([[True, True, True]])
    assert torch.equal(kl_k3_plus(logp, ref, mask), kl_k3(logp, ref, mask))
    grad = kl_grad(kl_k3_plus, logp, ref, mask)
    torch.testing.assert_close(grad, kl_grad(kl_k2, logp, ref, mask))
    torch.testing.assert_close(grad, logp - ref)  # d/dlogp of (ref - logp)^2 / 2
    # ... which differs from k3's gradient, 1 - exp(ref - logp).
    torch.testing.assert_close(kl_grad(kl_k3, logp, ref, mask), 1 - torch.exp(ref - logp))


@PROPERTY
@given(data=st.data(), name=st.sampled_from(sorted(KL_ESTIMATORS)), a=POISON, b=POISON)
def test_kl_masked_slots_change_nothing_and_get_zero_gradient(
    data: st.DataObject, name: str, a: float, b: float
) -> None:
    estimator = KL_ESTIMATORS[name]
    rows, cols = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 5))
    logp, ref = floats(data.draw, -5, 0, rows, cols), floats(data.draw, -5, 0, rows, cols)
    mask = masks(data.draw, rows, cols)
    value = estimator(logp, ref, mask)
    grad = kl_grad(estimator, logp, ref, mask)
    with nan_checks():
        poisoned_grad = kl_grad(
            estimator, torch.where(mask, logp, a), torch.where(mask, ref, b), mask
        )
    assert torch.equal(
        estimator(torch.where(mask, logp, a), torch.where(mask, ref, b), mask), value
    )
    assert torch.equal(poisoned_grad, grad)
    assert not (value[~mask] != 0).any()
    assert not (grad[~mask] != 0).any()
    if name != "k1":
        assert (value >= 0).all()
    on_policy = estimator(logp, logp, mask)
    assert torch.equal(on_policy, torch.zeros_like(on_policy))
