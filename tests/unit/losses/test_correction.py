"""Truncated importance weights for a sampler that is not the trainer (losses/correction.py),
on hand-computed numbers, and the identity the loops rely on: weighing the advantages weighs
each token's clipped surrogate term."""

from __future__ import annotations

import math

import pytest
import torch

from retrograd.losses.correction import truncated_is_weights, weigh_advantages
from retrograd.losses.policy import policy_loss

LOW, HIGH = 0.2, 0.28


def test_weights_are_the_probability_ratio_cut_at_the_cap():
    # π_old / μ = 1, e^0.5, e^-1, e^2 (cut to 2), then a padded position holding NaN
    old = torch.tensor([[-1.0, -0.5, -2.0], [-0.1, -3.0, 0.0]])
    sampler = torch.tensor([[-1.0, -1.0, -1.0], [-2.1, -3.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = truncated_is_weights(old, sampler, mask, cap=2.0)
    want = torch.tensor([[1.0, math.exp(0.5), math.exp(-1.0)], [2.0, 1.0, 0.0]])
    torch.testing.assert_close(out.w, want)
    assert out.mean == pytest.approx((1 + math.exp(0.5) + math.exp(-1) + 2 + 1) / 5)
    assert out.truncated == pytest.approx(1 / 5)  # e^2 > 2: the one cut
    assert not out.w.requires_grad


def test_a_sampler_that_is_the_trainer_weighs_every_token_one():
    lp = torch.tensor([[-0.7, -1.3], [-2.0, -0.2]])
    out = truncated_is_weights(lp, lp.clone(), torch.ones(2, 2), cap=1.0)
    assert torch.equal(out.w, torch.ones(2, 2))
    assert (out.mean, out.truncated) == (1.0, 0.0)


def test_far_apart_log_probabilities_stay_finite():
    old, sampler = torch.tensor([[0.0, -90.0]]), torch.tensor([[-90.0, 0.0]])
    out = truncated_is_weights(old, sampler, torch.ones(1, 2), cap=3.0)
    assert out.w[0, 0].item() == 3.0 and 0.0 <= out.w[0, 1].item() < 1e-8


def test_nothing_trained_and_a_cap_below_one():
    out = truncated_is_weights(torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1, 2), cap=2.0)
    assert torch.equal(out.w, torch.zeros(1, 2)) and (out.mean, out.truncated) == (1.0, 0.0)
    with pytest.raises(ValueError, match="at least 1"):
        truncated_is_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), cap=0.5)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_weighted_advantages_weigh_each_tokens_surrogate_term(level):
    """policy_loss over w-weighted advantages is Σ w_t ℓ_t / N: the loss and its gradient,
    with ratios inside and outside the clip range and advantages of both signs."""
    torch.manual_seed(0)
    logp = (torch.randn(3, 4, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(3, 4, dtype=torch.float64) * 0.4
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    w = torch.tensor([[0.5, 1.0, 2.0, 9.0], [1.5, 0.25, 1.0, 1.0], [2.0, 7.0, 7.0, 7.0]])
    w = w.double() * mask
    kw = dict(clip_low=LOW, clip_high=HIGH, level=level)
    weighted = policy_loss(logp, old, weigh_advantages(adv, w), mask, **kw)
    # by hand: each token's ratio (its answer's length-normalised one at sequence level), its
    # clipped term, weighted by w and summed over the trained tokens, over their count
    log_ratio = (logp - old).detach() * mask
    if level == "sequence":
        log_ratio = (log_ratio.sum(-1) / mask.sum(-1))[:, None].expand(3, 4)
    ratio = log_ratio.exp()
    a = adv[:, None]
    terms = -torch.minimum(ratio * a, ratio.clamp(1 - LOW, 1 + HIGH) * a)  # (3, 4)
    want = (w * terms * mask).sum() / mask.sum()
    torch.testing.assert_close(weighted.loss.detach(), want)
    (g_weighted,) = torch.autograd.grad(weighted.loss, logp)
    # each token's gradient is w times its unweighted one
    plain = policy_loss(logp, old, adv, mask, **kw)
    (g_plain,) = torch.autograd.grad(plain.loss, logp)
    torch.testing.assert_close(g_weighted, g_plain * w)
    assert g_weighted[~mask].abs().sum() == 0
