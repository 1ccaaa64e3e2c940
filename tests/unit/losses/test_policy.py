"""The clipped policy loss on hand-computed numbers: ratios, both clips, GSPO, k3, the mask, and
micro-batches with the update's normalizer."""

from __future__ import annotations

import math

import pytest
import torch

from retrograd.losses.policy import kl_k3, policy_loss

LOW, HIGH = 0.2, 0.28


def _grad(out_loss: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(out_loss, logp)
    return g


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_ratio_one_gives_minus_mean_advantage_over_tokens(level):
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -2.0])
    out = policy_loss(logp, logp.detach(), adv, mask, clip_low=LOW, clip_high=HIGH, level=level)
    # 5 trained tokens: -(2 * 1 + 3 * -2) / 5; each token's gradient is -A / 5.
    assert out.loss.item() == pytest.approx(0.8)
    assert out.surrogate.item() == pytest.approx(0.8)
    assert out.kl.item() == 0.0
    assert out.ratio_mean.item() == pytest.approx(1.0)
    assert out.clip_fraction.item() == 0.0
    assert out.ratio_min.item() == out.ratio_max.item() == 1.0
    assert out.clip_low_fraction.item() == out.clip_high_fraction.item() == 0.0
    want = torch.tensor([[-0.2, -0.2, 0.0], [0.4, 0.4, 0.4]])
    torch.testing.assert_close(_grad(out.loss, logp), want)


def test_clip_on_both_sides_with_both_signs():
    # One token per answer: ratio 1.5 and 0.5, each with A = +1 and A = -1.
    ratio = torch.tensor([[1.5], [1.5], [0.5], [0.5]], dtype=torch.float64)
    logp = ratio.log().requires_grad_()
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(4, 1, dtype=torch.bool)
    out = policy_loss(logp, torch.zeros_like(logp), adv, mask, clip_low=LOW, clip_high=HIGH)
    # 1.5, A>0: clipped to 1.28 (no gradient); 1.5, A<0: -1.5 kept (gradient 1.5);
    # 0.5, A>0: 0.5 kept (gradient -0.5); 0.5, A<0: clipped to 0.8 (no gradient).
    assert out.loss.item() == pytest.approx((-1.28 + 1.5 - 0.5 + 0.8) / 4)
    assert out.clip_fraction.item() == pytest.approx(0.5)
    # its two parts: 1.5 with A > 0 above the range, 0.5 with A < 0 below it
    assert out.clip_high_fraction.item() == pytest.approx(0.25)
    assert out.clip_low_fraction.item() == pytest.approx(0.25)
    assert out.ratio_mean.item() == pytest.approx(1.0)
    assert (out.ratio_min.item(), out.ratio_max.item()) == pytest.approx((0.5, 1.5))
    want = torch.tensor([[0.0], [1.5], [-0.5], [0.0]], dtype=torch.float64) / 4
    torch.testing.assert_close(_grad(out.loss, logp), want)


def test_sequence_level_equals_token_level_with_one_token_per_answer():
    torch.manual_seed(0)
    logp = (-torch.rand(6, 4) * 2).requires_grad_()
    old = logp.detach() + torch.randn(6, 4) * 0.4
    adv = torch.randn(6)
    mask = torch.zeros(6, 4, dtype=torch.bool)
    mask[torch.arange(6), torch.randint(0, 4, (6,))] = True
    ref = logp.detach() + torch.randn(6, 4) * 0.3
    kw = dict(clip_low=LOW, clip_high=HIGH, ref_logp=ref, kl_coef=0.05)
    tok = policy_loss(logp, old, adv, mask, level="token", **kw)
    seq = policy_loss(logp, old, adv, mask, level="sequence", **kw)
    assert 0 < tok.clip_fraction.item() < 1  # the draw clips some answers and not others
    for name in ("loss", "surrogate", "kl", "clip_fraction", "ratio_mean"):
        torch.testing.assert_close(getattr(seq, name), getattr(tok, name))
    torch.testing.assert_close(_grad(seq.loss, logp), _grad(tok.loss, logp))


def test_gspo_value_and_gradient():
    # Answer 0: one token, log ratio 0.1; answer 1: three tokens, log ratios 0.1, -0.3, 0.5.
    old = torch.zeros(2, 3, dtype=torch.float64)
    logp = torch.tensor([[0.1, 0.0, 0.0], [0.1, -0.3, 0.5]], dtype=torch.float64)
    logp.requires_grad_()
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    out = policy_loss(logp, old, adv, mask, clip_low=0.5, clip_high=0.5, level="sequence")
    s0, s1 = math.exp(0.1), math.exp(0.1)  # exp(mean log ratio) of each answer
    # Token-mean over 4 tokens: answer 1 counts three times; every token of an answer gets
    # -s A / 4 (not the paper's per-answer mean: our aggregation is DAPO's).
    assert out.loss.item() == pytest.approx(-(s0 * 2.0 + 3 * s1 * -1.0) / 4)
    want = torch.tensor([[-s0 * 2.0, 0, 0], [s1, s1, s1]], dtype=torch.float64) / 4
    torch.testing.assert_close(_grad(out.loss, logp), want)
    assert out.ratio_mean.item() == pytest.approx((s0 + s1) / 2)
    # The same gradient as differentiating the sequence ratio itself, answer by answer.
    n = mask.sum(-1)
    s = torch.exp((logp * mask).sum(-1) / n)
    torch.testing.assert_close(_grad(-(s * adv * n).sum() / 4, logp), want)


def test_sequence_clip_is_per_answer():
    old = torch.zeros(2, 2)
    logp = torch.tensor([[0.5, 0.5], [0.01, 0.03]], requires_grad=True)  # s = e^0.5, e^0.02
    mask = torch.ones(2, 2, dtype=torch.bool)
    out = policy_loss(
        logp, old, torch.ones(2), mask, clip_low=LOW, clip_high=HIGH, level="sequence"
    )
    assert out.clip_fraction.item() == 0.5  # answer 0 clipped at 1.28, answer 1 not
    assert out.clip_high_fraction.item() == 0.5 and out.clip_low_fraction.item() == 0.0
    g = _grad(out.loss, logp)
    assert torch.all(g[0] == 0) and torch.all(g[1] < 0)
    assert out.loss.item() == pytest.approx(-(2 * 1.28 + 2 * math.exp(0.02)) / 4, rel=1e-6)


def test_k3_value_gradient_and_zero_at_the_reference():
    logp = torch.tensor([[math.log(0.5), -1.3]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[math.log(0.25), -1.3]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    k = kl_k3(logp, ref)
    # x = log(0.25 / 0.5): e^x - x - 1 = 0.5 + ln 2 - 1; exactly 0 where logp == ref.
    assert k[0, 0].item() == pytest.approx(0.5 + math.log(2) - 1)
    assert k[0, 1].item() == 0.0
    out = policy_loss(
        logp, logp.detach(), torch.zeros(1), mask, clip_low=LOW, clip_high=HIGH,
        ref_logp=ref, kl_coef=0.1,
    )  # fmt: skip
    assert out.kl.item() == pytest.approx((0.5 + math.log(2) - 1) / 2)
    assert out.loss.item() == pytest.approx(0.1 * out.kl.item())
    # the gradient is k2's, d (x^2 / 2) / d logp = -x: ln 2 on the first token, 0 on the
    # second; times beta / 2 tokens (k3's own, 1 - e^x, would give 0.5 on the first)
    torch.testing.assert_close(
        _grad(out.loss, logp), torch.tensor([[0.05 * math.log(2), 0.0]], dtype=torch.float64)
    )


def test_k3_estimates_the_kl_of_torch_distributions():
    """Oracle we did not write: mean k3 over tokens sampled from π is KL(π ‖ π_ref)."""
    gen = torch.Generator().manual_seed(0)
    pi = torch.distributions.Categorical(logits=torch.randn(8, generator=gen, dtype=torch.float64))
    ref = torch.distributions.Categorical(logits=torch.randn(8, generator=gen, dtype=torch.float64))
    x = torch.multinomial(pi.probs, 200_000, replacement=True, generator=gen)
    k3 = kl_k3(pi.log_prob(x), ref.log_prob(x))
    want = torch.distributions.kl_divergence(pi, ref).item()
    assert k3.mean().item() == pytest.approx(want, rel=0.02)


def test_the_kl_terms_expected_gradient_is_that_of_kl_of_the_policy_to_the_reference():
    """Oracle we did not write (torch's kl_divergence, differentiated): on the policy's own
    samples the KL term's gradient is, in expectation, the gradient of KL(π ‖ π_ref), the
    divergence its value estimates, not that of KL(π_ref ‖ π) (k3's own gradient, weighted by
    π_ref / π: unbounded where the policy made a token the reference likes rare). Exact
    expectation over a categorical policy: Σ_y π(y) ∇ loss(y)."""
    gen = torch.Generator().manual_seed(0)
    theta = (2 * torch.randn(6, generator=gen, dtype=torch.float64)).requires_grad_()
    ref = torch.log_softmax(torch.randn(6, generator=gen, dtype=torch.float64), -1)
    logp = torch.log_softmax(theta, -1)
    p = logp.exp().detach()
    expected = sum(
        p[y]
        * policy_loss(
            logp[y].view(1, 1),
            logp[y].detach().view(1, 1),
            torch.zeros(1, dtype=torch.float64),
            torch.ones(1, 1),
            clip_low=LOW,
            clip_high=HIGH,
            ref_logp=ref[y].view(1, 1),
            kl_coef=1.0,
        ).loss
        for y in range(6)
    )
    got = torch.autograd.grad(expected, theta)[0]
    pi = torch.distributions.Categorical(logits=theta)
    toward = torch.distributions.kl_divergence(pi, torch.distributions.Categorical(logits=ref))
    torch.testing.assert_close(got, torch.autograd.grad(toward, theta)[0])


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_padding_gets_no_value_and_no_gradient(level):
    torch.manual_seed(1)
    logp = (-torch.rand(3, 5)).requires_grad_()
    old = logp.detach() + torch.randn(3, 5) * 0.2
    ref = logp.detach() + torch.randn(3, 5) * 0.2
    lengths = torch.tensor([5, 2, 3])
    mask = torch.arange(5)[None, :] < lengths[:, None]
    adv = torch.randn(3)
    kw = dict(clip_low=LOW, clip_high=HIGH, level=level, ref_logp=ref, kl_coef=0.1)
    clean = policy_loss(logp, old, adv, mask, **kw)
    junk = torch.tensor([float("nan"), float("inf"), -float("inf")])[torch.arange(15) % 3]
    dirty_logp = torch.where(mask, logp, junk.view(3, 5))
    bad_old = torch.where(mask, old, junk.view(3, 5).flip(1))
    bad_ref = torch.where(mask, ref, junk.view(3, 5))
    dirty = policy_loss(dirty_logp, bad_old, adv, mask, **{**kw, "ref_logp": bad_ref})
    stats = ("clip_fraction", "ratio_mean", "clip_low_fraction", "clip_high_fraction")
    for name in ("loss", "surrogate", "kl", *stats, "ratio_min", "ratio_max"):
        torch.testing.assert_close(getattr(dirty, name), getattr(clean, name))
    g = _grad(dirty.loss, logp)
    assert torch.isfinite(g).all() and torch.all(g[~mask] == 0)
    torch.testing.assert_close(g, _grad(clean.loss, logp))
    # A float mask reads like the bool one.
    as_float = policy_loss(logp, old, adv, mask.float(), **kw)
    torch.testing.assert_close(as_float.loss, clean.loss)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_micro_batches_with_the_update_normalizer_sum_to_the_whole(level):
    torch.manual_seed(2)
    logp = (-torch.rand(6, 7) * 3).double().requires_grad_()
    old = logp.detach() + torch.randn(6, 7, dtype=torch.float64) * 0.3
    ref = logp.detach() + torch.randn(6, 7, dtype=torch.float64) * 0.3
    mask = torch.arange(7)[None, :] < torch.tensor([7, 3, 1, 5, 6, 2])[:, None]
    adv = torch.randn(6, dtype=torch.float64)
    kw = dict(clip_low=LOW, clip_high=HIGH, level=level, kl_coef=0.04)
    whole = policy_loss(logp, old, adv, mask, ref_logp=ref, **kw)
    n = float(mask.sum())
    pieces = [
        policy_loss(logp[s], old[s], adv[s], mask[s], ref_logp=ref[s], normalizer=n, **kw)
        for s in (slice(0, 2), slice(2, 6))
    ]
    torch.testing.assert_close(sum(p.loss for p in pieces), whole.loss)
    torch.testing.assert_close(sum(p.kl for p in pieces), whole.kl)
    g_whole = _grad(whole.loss, logp)
    g_pieces = _grad(pieces[0].loss, logp) + _grad(pieces[1].loss, logp)
    torch.testing.assert_close(g_pieces, g_whole)
    # Without the update's count each piece divides by its own: not the whole's gradient.
    local = [policy_loss(logp[s], old[s], adv[s], mask[s], ref_logp=ref[s], **kw)
             for s in (slice(0, 2), slice(2, 6))]  # fmt: skip
    g_local = _grad(local[0].loss, logp) + _grad(local[1].loss, logp)
    assert not torch.allclose(g_local, g_whole)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_gradcheck_float64(level):
    torch.manual_seed(3)
    logp = (-torch.rand(3, 4, dtype=torch.float64) * 2).requires_grad_()
    old = logp.detach() + torch.randn(3, 4, dtype=torch.float64) * 0.5
    ref = logp.detach() + torch.randn(3, 4, dtype=torch.float64) * 0.5
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([0.7, -1.2, 0.4], dtype=torch.float64)

    def loss(lp):
        return policy_loss(
            lp, old, adv, mask, clip_low=LOW, clip_high=HIGH, level=level,
            ref_logp=ref, kl_coef=0.2,
        ).loss  # fmt: skip

    def f(lp):  # the surrogate plus 0.2 x the mean k2 (x^2 / 2), whose gradient the KL term has
        surrogate = policy_loss(lp, old, adv, mask, clip_low=LOW, clip_high=HIGH, level=level)
        k2 = (0.5 * (lp - ref) ** 2 * mask).sum() / mask.sum()
        return surrogate.loss + 0.2 * k2

    assert torch.autograd.gradcheck(f, (logp,))
    torch.testing.assert_close(_grad(loss(logp), logp), _grad(f(logp), logp))


def test_per_token_advantages_equal_broadcast_ones():
    torch.manual_seed(4)
    logp = (-torch.rand(2, 3)).requires_grad_()
    old = logp.detach() + torch.randn(2, 3) * 0.3
    mask = torch.ones(2, 3, dtype=torch.bool)
    adv = torch.tensor([0.5, -1.5])
    a = policy_loss(logp, old, adv, mask, clip_low=LOW, clip_high=HIGH)
    b = policy_loss(logp, old, adv[:, None].expand(2, 3), mask, clip_low=LOW, clip_high=HIGH)
    torch.testing.assert_close(a.loss, b.loss)
    torch.testing.assert_close(a.clip_fraction, b.clip_fraction)


def test_low_precision_inputs_compute_in_float32():
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16, requires_grad=True)
    old = torch.tensor([[-1.1, -1.9]], dtype=torch.bfloat16)
    ref = torch.tensor([[-1.2, -2.1]], dtype=torch.float16)
    out = policy_loss(
        logp, old, torch.tensor([1.0], dtype=torch.bfloat16), torch.ones(1, 2),
        clip_low=LOW, clip_high=HIGH, ref_logp=ref, kl_coef=0.1,
    )  # fmt: skip
    for name in ("loss", "surrogate", "kl", "clip_fraction", "ratio_mean"):
        assert getattr(out, name).dtype == torch.float32, name
    assert _grad(out.loss, logp).dtype == torch.bfloat16  # autograd returns the leaf's dtype


def test_nothing_to_train_is_a_zero_loss_with_zero_gradient():
    logp = torch.randn(2, 3, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for level in ("token", "sequence"):
        out = policy_loss(
            logp, logp.detach(), torch.ones(2), mask, clip_low=LOW, clip_high=HIGH, level=level
        )
        assert out.loss.item() == 0.0 and out.clip_fraction.item() == 0.0
        assert out.ratio_mean.item() == 0.0
        assert torch.all(_grad(out.loss, logp) == 0)


def test_refuses_an_unknown_level_and_kl_without_reference():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="level"):
        policy_loss(x, x, torch.zeros(1), x, clip_low=LOW, clip_high=HIGH, level="answer")
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(x, x, torch.zeros(1), x, clip_low=LOW, clip_high=HIGH, kl_coef=0.1)


def test_the_anchor_is_a_second_kl_term_of_the_same_form():
    """PPO's two KL terms: toward the sampler (ref_logp, kl_coef) and toward the reference
    (anchor_logp, anchor_coef). The anchor's value and gradient are those of the one-term
    loss with the anchor as its reference, and the loss adds the two with their weights."""
    torch.manual_seed(4)
    logp = (-torch.rand(3, 5) * 3).double().requires_grad_()
    old = logp.detach() + torch.randn(3, 5, dtype=torch.float64) * 0.2
    anchor = logp.detach() + torch.randn(3, 5, dtype=torch.float64) * 0.5
    mask = torch.arange(5)[None, :] < torch.tensor([5, 2, 4])[:, None]
    adv = torch.randn(3, 5, dtype=torch.float64)
    kw = dict(clip_low=0.2, clip_high=0.2)
    both = policy_loss(logp, old, adv, mask, ref_logp=old, kl_coef=0.1, anchor_logp=anchor,
                       anchor_coef=0.3, **kw)  # fmt: skip
    alone = policy_loss(logp, old, adv, mask, ref_logp=anchor, kl_coef=0.3, **kw)
    to_old = policy_loss(logp, old, adv, mask, ref_logp=old, kl_coef=0.1, **kw)
    torch.testing.assert_close(both.anchor_kl, alone.kl)
    torch.testing.assert_close(both.kl, to_old.kl)
    assert both.anchor_kl.item() > 0 and to_old.anchor_kl.item() == 0.0
    torch.testing.assert_close(both.loss, both.surrogate + 0.1 * both.kl + 0.3 * both.anchor_kl)
    g = _grad(both.loss, logp)
    g_parts = _grad(alone.loss + to_old.loss - to_old.surrogate, logp)
    torch.testing.assert_close(g, g_parts)
    with pytest.raises(ValueError, match="anchor_coef > 0 needs anchor_logp"):
        policy_loss(logp, old, adv, mask, anchor_coef=0.1, **kw)
