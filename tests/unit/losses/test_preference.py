"""Preference losses against their papers' formulas, transcribed here in plain Python math on
hand-made numbers: DPO (with cDPO smoothing), IPO, SimPO, ORPO; gradient signs, the statistics
behind preference/*, micro-batch normalizers and ORPO's clamp near certainty."""

from __future__ import annotations

import math

import pytest
import torch

from retrograd.losses.preference import (
    ORPO_LOGP_MAX,
    dpo_loss,
    ipo_loss,
    orpo_loss,
    simpo_loss,
)

# Three pairs: summed log-probabilities of the chosen / rejected answers under the policy and
# the reference, and their trained-token counts.
POL_C = [-12.0, -30.5, -4.25]
POL_R = [-15.0, -28.0, -9.0]
REF_C = [-13.0, -29.0, -5.0]
REF_R = [-14.0, -29.5, -8.0]
N_C = [4, 10, 2]
N_R = [6, 7, 3]


def t(xs, grad: bool = False) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64, requires_grad=grad)


def log_sigmoid(x: float) -> float:
    return -math.log(1.0 + math.exp(-x))


def paper_dpo(pc, pr, rc, rr, beta, eps=0.0):
    # Rafailov et al. eq. 7; cDPO: the label flipped with probability eps.
    z = beta * ((pc - rc) - (pr - rr))
    return -(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z)


def paper_ipo(pc, pr, rc, rr, nc, nr, beta):
    # Azar et al. eq. 17, tau = beta, log-ratios per token (TRL).
    return ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * beta)) ** 2


def paper_simpo(pc, pr, nc, nr, beta, gamma):
    # Meng et al. eq. 6: -log sigma(beta/|y_w| log pi(y_w) - beta/|y_l| log pi(y_l) - gamma).
    return -log_sigmoid(beta / nc * pc - beta / nr * pr - gamma)


def paper_orpo(pc, pr, nc, nr, lam):
    # Hong et al.: P(y|x) = exp(mean token log-prob); odds = P / (1 - P).
    p_c, p_r = math.exp(pc / nc), math.exp(pr / nr)
    odds_ratio = (p_c / (1 - p_c)) / (p_r / (1 - p_r))
    l_or = -math.log(odds_ratio / (1 + odds_ratio))  # -log sigma(log OR)
    return -pc / nc + lam * l_or


def per_token(logps, counts, scale: float = 1.0) -> list[float]:
    return [scale * p / n for p, n in zip(logps, counts, strict=True)]


def mean(xs) -> float:
    return sum(xs) / len(xs)


@pytest.mark.parametrize("beta,eps", [(0.1, 0.0), (0.5, 0.0), (0.1, 0.2), (2.0, 0.45)])
def test_dpo_matches_the_paper(beta, eps):
    out = dpo_loss(t(POL_C), t(POL_R), t(REF_C), t(REF_R), beta=beta, label_smoothing=eps)
    want = [paper_dpo(*row, beta, eps) for row in zip(POL_C, POL_R, REF_C, REF_R, strict=True)]
    torch.testing.assert_close(out.losses, t(want))
    assert out.loss.item() == pytest.approx(mean(want), rel=1e-12)
    # Rewards are beta times the log-ratios; the margin is their difference.
    chosen = [beta * (p - r) for p, r in zip(POL_C, REF_C, strict=True)]
    rejected = [beta * (p - r) for p, r in zip(POL_R, REF_R, strict=True)]
    torch.testing.assert_close(out.chosen_reward, t(chosen))
    torch.testing.assert_close(out.rejected_reward, t(rejected))
    torch.testing.assert_close(out.margin, t(chosen) - t(rejected))
    # Margins 2.0, -3.0, 1.75 (times beta): two of three pairs are ranked right.
    torch.testing.assert_close(out.accuracy, t([1.0, 0.0, 1.0]))
    torch.testing.assert_close(out.chosen_logps, t(POL_C))
    torch.testing.assert_close(out.rejected_logps, t(POL_R))
    assert out.nll is None and out.log_odds is None and out.orpo_clamped is None


def test_dpo_label_smoothing_zero_is_plain_dpo():
    args = (t(POL_C), t(POL_R), t(REF_C), t(REF_R))
    plain = dpo_loss(*args, beta=0.3)
    smooth0 = dpo_loss(*args, beta=0.3, label_smoothing=0.0)
    assert torch.equal(plain.losses, smooth0.losses)
    # -log sigma(z), written out by hand.
    z = [0.3 * ((a - b) - (c - d)) for a, c, b, d in zip(POL_C, POL_R, REF_C, REF_R, strict=True)]
    torch.testing.assert_close(plain.losses, t([math.log(1 + math.exp(-x)) for x in z]))
    # Smoothing pulls a confident pair's loss up: it also pays for the flipped label.
    assert (dpo_loss(*args, beta=0.3, label_smoothing=0.1).losses[0] > plain.losses[0]).item()


def test_dpo_at_the_reference_is_log_two_with_no_accuracy():
    same = t(POL_C)
    out = dpo_loss(same, t(POL_R), same, t(POL_R), beta=0.1, label_smoothing=0.3)
    torch.testing.assert_close(out.losses, t([math.log(2.0)] * 3))
    assert out.accuracy.sum().item() == 0.0  # a tie is not a win


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_ipo_matches_the_paper_per_token(beta):
    out = ipo_loss(t(POL_C), t(POL_R), t(REF_C), t(REF_R), t(N_C), t(N_R), beta=beta)
    rows = zip(POL_C, POL_R, REF_C, REF_R, N_C, N_R, strict=True)
    want = [paper_ipo(*row, beta) for row in rows]
    torch.testing.assert_close(out.losses, t(want))
    assert out.loss.item() == pytest.approx(mean(want), rel=1e-12)
    chosen = [beta * (p - r) / n for p, r, n in zip(POL_C, REF_C, N_C, strict=True)]
    torch.testing.assert_close(out.chosen_reward, t(chosen))


@pytest.mark.parametrize("beta,ratio", [(2.0, 0.5), (2.5, 0.0), (10.0, 0.3)])
def test_simpo_matches_the_paper(beta, ratio):
    out = simpo_loss(t(POL_C), t(POL_R), t(N_C), t(N_R), beta=beta, gamma_beta_ratio=ratio)
    rows = zip(POL_C, POL_R, N_C, N_R, strict=True)
    want = [paper_simpo(*row, beta, beta * ratio) for row in rows]
    torch.testing.assert_close(out.losses, t(want))
    assert out.loss.item() == pytest.approx(mean(want), rel=1e-12)
    # Rewards are beta times the mean token log-probability; the margin leaves gamma out.
    torch.testing.assert_close(out.chosen_reward, t(per_token(POL_C, N_C, beta)))
    torch.testing.assert_close(out.rejected_reward, t(per_token(POL_R, N_R, beta)))


def test_simpo_normalizes_by_length():
    # Same summed log-probabilities: the longer chosen answer has the better mean per token.
    short = simpo_loss(t([-8.0]), t([-8.0]), t([4]), t([4]), beta=2.0, gamma_beta_ratio=0.5)
    long = simpo_loss(t([-8.0]), t([-8.0]), t([16]), t([4]), beta=2.0, gamma_beta_ratio=0.5)
    assert long.loss.item() < short.loss.item()
    # Scaling an answer's log-probability and its length together changes nothing.
    doubled = simpo_loss(t([-16.0]), t([-8.0]), t([32]), t([4]), beta=2.0, gamma_beta_ratio=0.5)
    assert doubled.loss.item() == pytest.approx(long.loss.item(), rel=1e-12)
    # Equal means per token: only the target margin gamma remains, -log sigma(-gamma).
    assert short.loss.item() == pytest.approx(math.log(1 + math.exp(1.0)), rel=1e-12)


@pytest.mark.parametrize("lam", [0.1, 1.0])
def test_orpo_matches_the_paper(lam):
    out = orpo_loss(t(POL_C), t(POL_R), t(N_C), t(N_R), beta=lam)
    want = [paper_orpo(*row, lam) for row in zip(POL_C, POL_R, N_C, N_R, strict=True)]
    torch.testing.assert_close(out.losses, t(want))
    assert out.loss.item() == pytest.approx(mean(want), rel=1e-12)
    torch.testing.assert_close(out.nll, t(per_token(POL_C, N_C, -1.0)))
    log_odds = []
    for pc, pr, nc, nr in zip(POL_C, POL_R, N_C, N_R, strict=True):
        p_c, p_r = math.exp(pc / nc), math.exp(pr / nr)
        log_odds.append(math.log(p_c / (1 - p_c)) - math.log(p_r / (1 - p_r)))
    torch.testing.assert_close(out.log_odds, t(log_odds))
    assert not out.orpo_clamped.any()
    # Means per token: -3 vs -2.5, -3.05 vs -4, -2.125 vs -3.
    torch.testing.assert_close(out.accuracy, t([0.0, 1.0, 1.0]))
    torch.testing.assert_close(out.chosen_reward, t(per_token(POL_C, N_C, lam)))


def _one_pair(name: str, pc: torch.Tensor, pr: torch.Tensor):
    """The named loss on a single pair of 5-token answers (reference -6 nats each)."""
    ref, n = t([-6.0]), t([5])
    return {
        "dpo": lambda: dpo_loss(pc, pr, ref, ref, beta=0.1),
        "dpo_smoothed": lambda: dpo_loss(pc, pr, ref, ref, beta=0.1, label_smoothing=0.2),
        "ipo": lambda: ipo_loss(pc, pr, ref, ref, n, n, beta=0.1),
        "simpo": lambda: simpo_loss(pc, pr, n, n),
        "orpo": lambda: orpo_loss(pc, pr, n, n),
    }[name]()


@pytest.mark.parametrize("name", ["dpo", "dpo_smoothed", "ipo", "simpo", "orpo"])
def test_raising_chosen_or_lowering_rejected_lowers_the_loss(name):
    pc, pr = t([-6.0], grad=True), t([-6.5], grad=True)
    out = _one_pair(name, pc, pr)
    g_c, g_r = torch.autograd.grad(out.loss, (pc, pr))
    assert g_c.item() < 0 < g_r.item()
    # A real step, not only the sign: half a nat more chosen, or half a nat less rejected.
    before = out.loss.item()
    assert _one_pair(name, t([-5.5]), t([-6.5])).loss.item() < before
    assert _one_pair(name, t([-6.0]), t([-7.0])).loss.item() < before


def test_dpo_gradient_is_beta_times_sigmoid_of_minus_z():
    # d/dh_c [-log sigma(beta * delta)] = -beta * sigma(-beta * delta).
    pc = t([-10.0], grad=True)
    out = dpo_loss(pc, t([-12.0]), t([-11.0]), t([-11.0]), beta=0.5)
    (g,) = torch.autograd.grad(out.loss, pc)
    z = 0.5 * (1.0 - (-1.0))
    assert g.item() == pytest.approx(-0.5 / (1 + math.exp(z)), rel=1e-12)


def test_statistics_carry_no_graph_and_loss_does():
    pc = t(POL_C, grad=True)
    for out in (
        dpo_loss(pc, t(POL_R), t(REF_C), t(REF_R)),
        orpo_loss(pc, t(POL_R), t(N_C), t(N_R)),
    ):
        assert out.loss.requires_grad and out.loss.dim() == 0
        for field in ("losses", "chosen_reward", "rejected_reward", "chosen_logps", "nll"):
            value = getattr(out, field)
            assert value is None or not value.requires_grad, field


@pytest.mark.parametrize("name", ["dpo", "ipo", "simpo", "orpo"])
def test_micro_batches_with_the_step_normalizer_sum_to_the_whole(name):
    def run(sl: slice, normalizer=None):
        pc = t(POL_C[sl], grad=True)
        args = {
            "dpo": (pc, t(POL_R[sl]), t(REF_C[sl]), t(REF_R[sl])),
            "ipo": (pc, t(POL_R[sl]), t(REF_C[sl]), t(REF_R[sl]), t(N_C[sl]), t(N_R[sl])),
            "simpo": (pc, t(POL_R[sl]), t(N_C[sl]), t(N_R[sl])),
            "orpo": (pc, t(POL_R[sl]), t(N_C[sl]), t(N_R[sl])),
        }[name]
        fn = {"dpo": dpo_loss, "ipo": ipo_loss, "simpo": simpo_loss, "orpo": orpo_loss}[name]
        out = fn(*args, normalizer=normalizer)
        (g,) = torch.autograd.grad(out.loss, pc)
        return out.loss.item(), g

    whole, g_whole = run(slice(0, 3))
    a, g_a = run(slice(0, 2), normalizer=3)
    b, g_b = run(slice(2, 3), normalizer=3)
    assert a + b == pytest.approx(whole, rel=1e-12)
    torch.testing.assert_close(torch.cat([g_a, g_b]), g_whole)


def test_low_precision_inputs_are_computed_in_float32():
    bf = torch.tensor(POL_C, dtype=torch.bfloat16)
    out = simpo_loss(bf, torch.tensor(POL_R, dtype=torch.bfloat16), t(N_C), t(N_R))
    assert out.loss.dtype == torch.float32 and out.chosen_logps.dtype == torch.float32
    counts = torch.tensor(N_C, dtype=torch.int64)  # integer counts are fine too
    out = orpo_loss(t(POL_C).float(), t(POL_R).float(), counts, torch.tensor(N_R))
    assert out.loss.dtype == torch.float32


def test_orpo_clamps_an_answer_the_policy_is_certain_of():
    # Chosen certain (mean log-probability 0), rejected not: the log odds would be +inf.
    pc = t([0.0, -1e-3, -2.0], grad=True)
    pr = t([-3.0, -3.0, 0.0], grad=True)
    out = orpo_loss(pc, pr, t([3, 3, 3]), t([3, 3, 3]), beta=0.1)
    assert out.orpo_clamped.tolist() == [True, False, True]
    assert torch.isfinite(out.losses).all() and torch.isfinite(out.log_odds).all()
    g_c, g_r = torch.autograd.grad(out.loss, (pc, pr))
    assert torch.isfinite(g_c).all() and torch.isfinite(g_r).all()
    # The clamped value is the log odds at ORPO_LOGP_MAX, written out by hand.
    p_max = math.exp(ORPO_LOGP_MAX)
    at_max = math.log(p_max / (1 - p_max))
    p_r = math.exp(-1.0)
    assert out.log_odds[0].item() == pytest.approx(at_max - math.log(p_r / (1 - p_r)), rel=1e-6)
    # Pair 1, near but not at certainty (mean -1/3000), is exact: no clamp.
    assert out.losses[1].item() == pytest.approx(paper_orpo(-1e-3, -3.0, 3, 3, 0.1), rel=1e-9)
    # A clamped answer's odds term is flat: the chosen gradient of pair 0 is its NLL's alone,
    # -1/|y| / P; the rejected answer of pair 2, clamped, gets no gradient at all.
    assert g_c[0].item() == pytest.approx(-1 / 3 / 3, rel=1e-12)
    assert g_r[2].item() == 0.0


def test_orpo_clamp_edge_cases():
    # Both answers certain: both clamped to the same value, log odds 0, -log sigma(0) = log 2.
    out = orpo_loss(t([0.0]), t([0.0]), t([2]), t([5]), beta=0.5)
    assert out.orpo_clamped.tolist() == [True]
    assert out.log_odds.item() == 0.0
    assert out.loss.item() == pytest.approx(0.5 * math.log(2.0), rel=1e-12)
    # A mean log-probability above 0 (rounding in a caller's sum) is clamped too, not NaN.
    out = orpo_loss(t([1e-9]), t([-4.0]), t([1]), t([2]))
    assert out.orpo_clamped.tolist() == [True] and torch.isfinite(out.loss)
    # Just inside the limit is not clamped; just past it is.
    n = 4
    inside = orpo_loss(t([ORPO_LOGP_MAX * n * 1.01]), t([-4.0]), t([n]), t([2]))
    past = orpo_loss(t([ORPO_LOGP_MAX * n * 0.99]), t([-4.0]), t([n]), t([2]))
    assert inside.orpo_clamped.tolist() == [False] and past.orpo_clamped.tolist() == [True]
    # Float32 input near certainty stays finite (1 - e^l would round to 0 without expm1).
    out = orpo_loss(torch.tensor([-2e-6]), torch.tensor([-5.0]), t([1]), t([1]))
    assert not out.orpo_clamped.any() and torch.isfinite(out.log_odds).all()
    p_c, p_r = math.exp(-2e-6), math.exp(-5.0)
    want = math.log(p_c / (1 - p_c)) - math.log(p_r / (1 - p_r))
    assert out.log_odds.item() == pytest.approx(want, rel=1e-4)
