"""PPO's advantages on hand-made rollouts: without a critic every token carries its answer's
whitened reward; with a critic they are GAE over the head's values, whitened, and the returns
are the head's targets."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from retrograd.algorithms.ppo import _advantages, _old_values
from retrograd.data.prompts import Prompt
from retrograd.distributed import World
from retrograd.errors import RewardError
from retrograd.rollout.records import Rollout
from retrograd.trainable.value_head import ValueHead


def _answers(rewards: list[float], lengths: list[int]) -> list[Rollout]:
    prompt = Prompt("p.jsonl:1", 0, ({"role": "user", "content": "hi"},), "hi", (1, 2, 3))
    out = []
    for i, (r, n) in enumerate(zip(rewards, lengths, strict=True)):
        a = Rollout(prompt, 1, i, 0, i, tuple(range(n)), "x", False, np.zeros(n, np.float32))
        a.reward_raw = r
        out.append(a)
    return out


def _cfg(gamma=1.0, lam=0.95):
    return SimpleNamespace(ppo=SimpleNamespace(critic=SimpleNamespace(gamma=gamma, gae_lambda=lam)))


def test_without_a_critic_every_token_carries_its_answers_whitened_reward():
    answers = _answers([1.0, 0.0, 0.5], [2, 3, 1])
    returns, spread, explained = _advantages(_cfg(), answers, None)
    assert returns is None and math.isnan(explained)  # no critic, nothing explained
    tokens = np.array([1.0, 1.0, 0.0, 0.0, 0.0, 0.5])  # each answer's reward on its tokens
    assert spread == pytest.approx(tokens.std())  # batch/advantage_std: before whitening
    want = (tokens - tokens.mean()) / tokens.std()
    got = np.concatenate([a.token_advantages for a in answers])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert answers[0].advantage == pytest.approx(want[0], rel=1e-6)


def test_equal_rewards_carry_no_signal():
    answers = _answers([0.3, 0.3], [2, 4])
    _advantages(_cfg(), answers, None)
    assert all(np.all(a.token_advantages == 0) for a in answers)


@pytest.mark.parametrize("rewards", [[1e308, -1e308, 0.0], [1e39, 0.0], [1e200, 0.0]])
def test_rewards_too_large_for_the_arithmetic_are_a_reward_error(rewards):
    """Finite rewards (each reply was checked) whose whitening overflows float64, or whose
    returns overflow the critic's float32 targets: named as the rewards' fault, not a NaN loss."""
    answers = _answers(rewards, [2] * len(rewards))
    with pytest.raises(RewardError, match=r"update 1: the rewards \(up to .*\) overflow"):
        _advantages(_cfg(), answers, None)
    fine = _answers([1e30, 0.0], [2, 2])  # large, but every step of the arithmetic is finite
    _advantages(_cfg(), fine, None)
    assert np.isfinite(np.concatenate([a.token_advantages for a in fine])).all()


def test_with_a_critic_advantages_are_whitened_gae_over_the_heads_values():
    torch.manual_seed(0)
    answers = _answers([1.0, 0.0], [3, 2])
    head = ValueHead(4, lr=0.01)
    with torch.no_grad():
        head.linear.weight.copy_(torch.tensor([[1.0, -2.0, 0.5, 0.0]]))
        head.linear.bias.fill_(0.1)
    features = [torch.randn(3, 4), torch.randn(2, 4)]
    gamma, lam = 0.9, 0.8
    old = _old_values(head, features, World())  # one process: its own answers' values
    returns, spread, explained = _advantages(_cfg(gamma, lam), answers, old)
    raw, rets = [], []
    for a, f in zip(answers, features, strict=True):
        v = head(f).detach().double().numpy()
        n = len(v)
        r = np.zeros(n)
        r[-1] = a.reward
        v_next = np.append(v[1:], 0.0)
        delta = r + gamma * v_next - v
        adv = np.array(
            [sum((gamma * lam) ** (k - t) * delta[k] for k in range(t, n)) for t in range(n)]
        )
        raw.append(adv)
        rets.append(adv + v)
    flat = np.concatenate(raw)
    assert spread == pytest.approx(flat.std(), rel=1e-5)
    want = (flat - flat.mean()) / flat.std()
    got = np.concatenate([a.token_advantages for a in answers])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(returns[0, :3].numpy(), rets[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(returns[1, :2].numpy(), rets[1], rtol=1e-5, atol=1e-6)
    # critic/explained_variance: 1 - Var(R - V) / Var(R) over the tokens, R - V the raw GAE
    all_returns = np.concatenate(rets)
    assert explained == pytest.approx(1 - flat.var() / all_returns.var(), rel=1e-6)
