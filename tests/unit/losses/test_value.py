"""PPO's critic side against references written here from the formulas: GAE on random rewards
and values (gamma < 1, lambda 0 and 1), whitening, the value loss and PPO's clipped surrogate
with a KL toward the sampling policy on hand-computed numbers, the critic's explained variance."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from retrograd.losses.policy import policy_loss
from retrograd.losses.value import explained_variance, gae, value_loss, whiten


def reference_gae(rewards, values, gamma, lam):
    """One answer, straight from the definition: Â_t = Σ_l (γλ)^l δ_{t+l}, with
    δ_t = r_t + γ V_{t+1} − V_t and V after the last token 0."""
    n = len(rewards)
    v_next = list(values[1:]) + [0.0]
    delta = [rewards[t] + gamma * v_next[t] - values[t] for t in range(n)]
    adv = [sum((gamma * lam) ** (k - t) * delta[k] for k in range(t, n)) for t in range(n)]
    returns = [a + v for a, v in zip(adv, values, strict=True)]
    return adv, returns


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.0), (0.9, 1.0), (0.7, 0.5), (1.0, 1.0)])
def test_gae_equals_the_direct_sum_on_random_rows(gamma, lam):
    rng = np.random.default_rng(int(gamma * 100 + lam * 10))
    lengths = [5, 1, 3, 7]
    width = max(lengths)
    rewards = torch.tensor(rng.normal(size=(4, width)))
    values = torch.tensor(rng.normal(size=(4, width)))
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    rewards[mask == 0] = float("nan")  # padding may hold anything
    values[mask == 0] = 1e6
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    for i, n in enumerate(lengths):
        want_adv, want_ret = reference_gae(
            rewards[i, :n].tolist(), values[i, :n].tolist(), gamma, lam
        )
        np.testing.assert_allclose(adv[i, :n].numpy(), want_adv, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(ret[i, :n].numpy(), want_ret, rtol=1e-12, atol=1e-12)
        assert torch.all(adv[i, n:] == 0) and torch.all(ret[i, n:] == 0)


def test_gae_lambda_zero_is_the_one_step_error_and_lambda_one_the_discounted_return():
    r = torch.tensor([[0.0, 0.0, 2.0]])
    v = torch.tensor([[0.5, 1.0, 1.5]])
    m = torch.ones(1, 3)
    adv0, _ = gae(r, v, m, gamma=0.5, lam=0.0)
    # δ = r + γ V_next − V: 0 + 0.5 - 0.5, 0 + 0.75 - 1, 2 + 0 - 1.5
    torch.testing.assert_close(adv0, torch.tensor([[0.0, -0.25, 0.5]], dtype=torch.float64))
    adv1, ret1 = gae(r, v, m, gamma=0.5, lam=1.0)
    # λ = 1: returns are the discounted reward-to-go 0.5, 1, 2 whatever the values
    torch.testing.assert_close(ret1, torch.tensor([[0.5, 1.0, 2.0]], dtype=torch.float64))
    torch.testing.assert_close(adv1, ret1 - v.double())


def test_whiten_gives_mean_zero_unit_variance_on_the_mask_and_zeros_without_signal():
    x = torch.tensor([[1.0, 2.0, 99.0], [3.0, 4.0, 5.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 1]])
    w = whiten(x, m)
    vals = w[m.bool()]
    assert vals.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert (vals**2).mean().item() == pytest.approx(1.0, rel=1e-6)
    assert w[0, 2].item() == 0.0
    # (1 - 3) / sqrt(2): mean 3, population variance 2 over 1..5
    assert w[0, 0].item() == pytest.approx(-2 / math.sqrt(2.0))
    flat = whiten(torch.full((2, 3), 0.7), torch.ones(2, 3))
    assert torch.all(flat == 0)


def test_value_loss_is_half_the_mean_squared_error_over_trained_tokens():
    v = torch.tensor([[1.0, 2.0, 5.0], [0.0, -1.0, 3.0]], requires_grad=True)
    r = torch.tensor([[0.0, 2.0, 0.0], [1.0, 1.0, 3.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss = value_loss(v, r, m)
    # errors 1, 0, -1, -2, 0 over 5 tokens: ½ (1 + 0 + 1 + 4 + 0) / 5
    assert loss.item() == pytest.approx(0.6)
    (g,) = torch.autograd.grad(loss, v)
    torch.testing.assert_close(g, torch.tensor([[0.2, 0.0, 0.0], [-0.2, -0.4, 0.0]]))
    # a normalizer (the update's tokens, over micro-batches) replaces the count
    assert value_loss(v, r, m, normalizer=10).item() == pytest.approx(0.3)


def test_ppo_surrogate_with_one_clip_range_and_kl_toward_the_sampling_policy():
    """PPO calls the shared loss with clip_low = clip_high = clip_range, per-token advantages
    and the sampling policy's log-probabilities as the KL's anchor."""
    eps, beta = 0.2, 0.1
    old = torch.zeros(1, 3, dtype=torch.float64)
    ratio = torch.tensor([[1.5, 0.5, 1.1]], dtype=torch.float64)
    logp = ratio.log().requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)
    m = torch.ones(1, 3)
    out = policy_loss(logp, old, adv, m, clip_low=eps, clip_high=eps, ref_logp=old, kl_coef=beta)
    # token 1: 1.5 with A = 1 clipped to 1.2; token 2: 0.5 with A = -1 clipped to 0.8;
    # token 3: 1.1 inside, 2.2. Surrogate −(1.2 − 0.8 + 2.2) / 3.
    assert out.surrogate.item() == pytest.approx(-(1.2 - 0.8 + 2.2) / 3)
    assert out.clip_fraction.item() == pytest.approx(2 / 3)
    # k3 with x = log π_old − log π = −log ρ: 1/ρ + log ρ − 1
    k3 = [1 / p + math.log(p) - 1 for p in (1.5, 0.5, 1.1)]
    assert out.kl.item() == pytest.approx(sum(k3) / 3)
    assert out.loss.item() == pytest.approx(out.surrogate.item() + beta * sum(k3) / 3)
    (g,) = torch.autograd.grad(out.loss, logp)
    # d/dlogp: surrogate −A ρ / 3 on the unclipped token only; the KL term's is k2's,
    # β log ρ / 3 on each (losses/policy.py: k3's value, k2's gradient)
    want = [
        beta * math.log(1.5) / 3,
        beta * math.log(0.5) / 3,
        (-2.0 * 1.1 + beta * math.log(1.1)) / 3,
    ]
    np.testing.assert_allclose(g[0].numpy(), want, rtol=1e-9)


def test_explained_variance_of_perfect_constant_and_noisy_values():
    torch.manual_seed(0)
    returns = torch.rand(4, 6, dtype=torch.float64)
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0  # padding: whatever it holds is not read
    junk = returns.clone()
    junk[1, 4:] = 1e6
    assert explained_variance(returns, junk, mask) == pytest.approx(1.0)
    # a constant (the batch's mean or any other) explains nothing
    assert explained_variance(torch.full_like(returns, 0.3), returns, mask) == pytest.approx(0.0)
    # values uncorrelated with the returns add their own variance
    noisy = torch.rand(4, 6, dtype=torch.float64)
    ev = explained_variance(noisy, returns, mask)
    keep = mask.bool()
    want = 1 - (returns - noisy)[keep].var(unbiased=False) / returns[keep].var(unbiased=False)
    assert ev == pytest.approx(float(want)) and ev < 0


def test_explained_variance_is_nan_where_the_returns_do_not_vary():
    returns = torch.full((2, 3), 0.75)
    assert math.isnan(explained_variance(torch.zeros(2, 3), returns, torch.ones(2, 3)))
