"""Distillation losses against direct transcriptions of their formulas on hand-made numbers,
and the on-policy estimator lowering the reverse KL of a categorical student."""

from __future__ import annotations

import math

import pytest
import torch

from retrograd.losses.distill import full_kl, log1mexp, reverse_kl_advantages, topk_forward_kl
from retrograd.losses.policy import policy_loss


def test_reverse_kl_advantages_are_the_capped_negated_log_ratio():
    student = torch.tensor([[-1.0, -2.0, -0.5, -9.0]])
    teacher = torch.tensor([[-1.5, -0.5, -7.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, k, clipped = reverse_kl_advantages(student, teacher, mask, weight_clip=5.0)
    # k = student - teacher: 0.5, -1.5, 6.5 (capped to 5 in the advantage), masked 0
    assert k.tolist() == [[0.5, -1.5, 6.5, 0.0]]
    assert adv.tolist() == [[-0.5, 1.5, -5.0, 0.0]]
    assert clipped.tolist() == [[False, False, True, False]]


def test_log1mexp_at_both_ends():
    x = torch.tensor([-1e-6, -0.1, -0.7, -5.0, -40.0], dtype=torch.float64)
    want = [math.log(1 - math.exp(v)) for v in x.tolist()]
    assert torch.allclose(log1mexp(x), torch.tensor(want, dtype=torch.float64), rtol=1e-6)


def test_topk_kl_is_the_kl_of_the_k_tokens_and_the_tail():
    # teacher over 4 tokens: 0.5, 0.3 (top-2), tail 0.2; student 0.25, 0.25, tail 0.5
    t = torch.log(torch.tensor([[0.5, 0.3]]))
    s = torch.log(torch.tensor([[0.25, 0.25]]))
    want = 0.5 * math.log(0.5 / 0.25) + 0.3 * math.log(0.3 / 0.25) + 0.2 * math.log(0.2 / 0.5)
    assert topk_forward_kl(s, t).item() == pytest.approx(want, rel=1e-6)
    assert topk_forward_kl(t, t).item() == pytest.approx(0.0, abs=1e-7)


def test_topk_kl_over_the_whole_vocabulary_is_the_full_kl():
    g = torch.Generator().manual_seed(0)
    ls, lt = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g) * 2
    s, t = torch.log_softmax(ls, -1), torch.log_softmax(lt, -1)
    ids = torch.argsort(t, -1, descending=True)
    forward, reverse = full_kl(ls, lt)
    got = topk_forward_kl(s.gather(1, ids), t.gather(1, ids))
    assert torch.allclose(got, forward, atol=1e-5)
    assert torch.allclose(reverse, (s.exp() * (s - t)).sum(-1), atol=1e-6)
    assert (forward > 0).all() and (reverse > 0).all()


def test_topk_kl_gradient_matches_float64_autograd_of_the_formula():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 9, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.log_softmax(torch.randn(2, 9, generator=g, dtype=torch.float64), -1)
    ids = torch.argsort(t, -1, descending=True)[:, :3]

    def f(z):
        return topk_forward_kl(torch.log_softmax(z, -1).gather(1, ids), t.gather(1, ids)).sum()

    assert torch.autograd.gradcheck(f, (logits,))


def test_the_on_policy_estimator_lowers_a_categorical_students_reverse_kl():
    """Sampled tokens, advantages −(log π − log p_T) capped, the clipped surrogate at ratio 1,
    AdamW: the student's KL(π ‖ p_T) falls from 1.6 nats to near 0."""
    torch.manual_seed(0)
    teacher = torch.log_softmax(torch.randn(20) * 2, -1)
    theta = torch.zeros(20, requires_grad=True)
    opt = torch.optim.AdamW([theta], lr=0.05, weight_decay=0.0)

    def kl() -> float:
        with torch.no_grad():
            s = torch.log_softmax(theta, -1)
            return float((s.exp() * (s - teacher)).sum())

    start = kl()
    for _ in range(300):
        s = torch.log_softmax(theta, -1)
        x = torch.multinomial(s.exp().detach(), 16, replacement=True)
        logp = s[x][None]
        adv, _, _ = reverse_kl_advantages(logp.detach(), teacher[x][None], torch.ones(1, 16), 5.0)
        out = policy_loss(logp, logp.detach(), adv, torch.ones(1, 16), clip_low=0.2, clip_high=0.28)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert start > 1.0
    assert kl() < 0.05 * start
