"""Preference losses (DPO, IPO, SimPO, ORPO): pure functions of per-pair log-probabilities.

It knows nothing about models, tokenizers or pair files. The caller scores each pair's chosen
and rejected answers: the summed log-probability of the answer's trained (model-written)
tokens under the policy (`chosen_logps`, `rejected_logps`, with gradient), under the reference
where the loss reads one (`ref_chosen_logps`, `ref_rejected_logps`, no gradient), and the
number of trained tokens (`chosen_tokens`, `rejected_tokens`) where the loss normalizes by
length. Each function returns the mean loss over pairs and the per-pair statistics behind the
spec's `preference/*` metrics (formats.md §7.2). The variants, where the papers and the peers
differ (rl-math.md §3.6; the spec wins):

- dpo: the sigmoid loss with cDPO's label smoothing ε (TRL's conservative DPO), not TRL's
  "robust" variant; ε = 0 is the paper's loss exactly.
- ipo: TRL's per-token form, the log-ratios divided by answer length before the square
  (confirmed with the IPO authors, TRL says); the paper's eq. 17 uses summed log-ratios.
- simpo: the SimPO authors' own loss, no label smoothing (the spec's label_smoothing is dpo's).
- orpo: NLL of the chosen answer, per token, per pair, then the mean over pairs (the paper's
  expectation over pairs; TRL's older code took one token mean over the whole batch).

Rewards, the margin and the accuracy follow TRL: β·log-ratio for dpo (and, per token, ipo);
β·mean log-probability for simpo and orpo; margin = chosen − rejected reward; a pair is
accurate when its margin is strictly positive (a tie, as at the first step of DPO, is not).
`chosen_logps` / `rejected_logps` are always the summed log-probabilities as given, in nats,
whatever the loss: the unit `logps_drop_warn` speaks in.

NOTE: ORPO's log odds, ℓ − log(1 − e^ℓ) for the mean log-probability ℓ, is infinite at ℓ = 0
(an answer the policy is certain of) and its slope 1/(1 − e^ℓ) explodes near it. ℓ is clamped
to at most ORPO_LOGP_MAX first; the clamp is flat there, so a clamped answer's odds term gives
no gradient (its NLL still does), and `orpo_clamped` says which pairs were touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# Mean log-probability ORPO's log odds may see: the answer's mean token probability stays
# below 1 − 1e-6, the log odds below log(1e6) ≈ 13.8, its slope below 1e6.
ORPO_LOGP_MAX = -1e-6

# loss -> whether it reads reference log-probabilities ([preference].reference).
NEEDS_REFERENCE = {"dpo": True, "ipo": True, "simpo": False, "orpo": False}


@dataclass(frozen=True)
class PreferenceLossOut:
    """`loss` is a scalar with the graph: the per-pair losses summed and divided by the
    normalizer (by default this call's pair count). Every other field is detached and per pair,
    shape (P,); the ORPO-only fields are None for the other losses."""

    loss: Tensor
    losses: Tensor  # each pair's loss
    chosen_reward: Tensor
    rejected_reward: Tensor
    chosen_logps: Tensor  # summed policy log-probabilities, as given
    rejected_logps: Tensor
    nll: Tensor | None = None  # ORPO: the chosen answer's mean NLL per token
    log_odds: Tensor | None = None  # ORPO: log odds(chosen) − log odds(rejected)
    orpo_clamped: Tensor | None = None  # ORPO: bool, either answer's ℓ clamped

    @property
    def margin(self) -> Tensor:
        return self.chosen_reward - self.rejected_reward

    @property
    def accuracy(self) -> Tensor:
        """1.0 where the chosen answer's reward is strictly above the rejected one's."""
        return (self.margin > 0).to(self.margin.dtype)


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    normalizer: float | None = None,
) -> PreferenceLossOut:
    """DPO (Rafailov et al. 2023, arXiv 2305.18290, eq. 7) with cDPO label smoothing ε
    (Mitchell 2023, "A note on DPO with noisy preferences"; TRL's sigmoid loss):

        h = log π(y|x) − log π_ref(y|x),   Δ = h_c − h_r
        L = −(1 − ε) log σ(βΔ) − ε log σ(−βΔ)

    All inputs (P,): summed log-probabilities of each answer's trained tokens."""
    assert beta > 0 and 0.0 <= label_smoothing < 0.5, (beta, label_smoothing)
    dtype = _dtype(chosen_logps)
    h_c = chosen_logps.to(dtype) - ref_chosen_logps.to(dtype)  # (P,)
    h_r = rejected_logps.to(dtype) - ref_rejected_logps.to(dtype)  # (P,)
    z = beta * (h_c - h_r)  # (P,)
    losses = -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return _out(losses, beta * h_c, beta * h_r, chosen_logps, rejected_logps, normalizer)


def ipo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    *,
    beta: float = 0.1,
    normalizer: float | None = None,
) -> PreferenceLossOut:
    """IPO (Azar et al. 2023, arXiv 2310.12036, eq. 17 with τ = β), per token as TRL has it:

        Δ̄ = h_c / |y_c| − h_r / |y_r|,   L = (Δ̄ − 1/(2β))²

    h as in DPO; |y| the answer's trained tokens."""
    assert beta > 0, beta
    dtype = _dtype(chosen_logps)
    h_c = _per_token(chosen_logps.to(dtype) - ref_chosen_logps.to(dtype), chosen_tokens)  # (P,)
    h_r = _per_token(rejected_logps.to(dtype) - ref_rejected_logps.to(dtype), rejected_tokens)
    losses = (h_c - h_r - 1.0 / (2.0 * beta)) ** 2  # (P,)
    return _out(losses, beta * h_c, beta * h_r, chosen_logps, rejected_logps, normalizer)


def simpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    *,
    beta: float = 2.0,
    gamma_beta_ratio: float = 0.5,
    normalizer: float | None = None,
) -> PreferenceLossOut:
    """SimPO (Meng, Xia and Chen 2024, arXiv 2405.14734, eq. 6), no reference model:

    r(y) = (β / |y|) log π(y|x),   γ = β · gamma_beta_ratio
    L = −log σ(r(y_c) − r(y_r) − γ)"""
    assert beta > 0, beta
    dtype = _dtype(chosen_logps)
    r_c = beta * _per_token(chosen_logps.to(dtype), chosen_tokens)  # (P,)
    r_r = beta * _per_token(rejected_logps.to(dtype), rejected_tokens)  # (P,)
    losses = -F.logsigmoid(r_c - r_r - beta * gamma_beta_ratio)  # (P,)
    return _out(losses, r_c, r_r, chosen_logps, rejected_logps, normalizer)


def orpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    *,
    beta: float = 0.1,
    normalizer: float | None = None,
) -> PreferenceLossOut:
    """ORPO (Hong, Lee and Thorne 2024, arXiv 2403.07691; the odds ratio eq. 4 and L_OR eq. 7,
    as TRL cites them), no reference model, with the mean log-probability ℓ = log π(y|x) / |y|
    (the paper's P(y|x) = e^ℓ):

        log odds(y) = ℓ − log(1 − e^ℓ)
        L_OR = −log σ(log odds(y_c) − log odds(y_r)),   L_NLL = −ℓ_c
        L = L_NLL + β · L_OR        (β is the paper's λ)

    ℓ is clamped to at most ORPO_LOGP_MAX before the log odds (see the module's NOTE)."""
    assert beta > 0, beta
    dtype = _dtype(chosen_logps)
    ell_c = _per_token(chosen_logps.to(dtype), chosen_tokens)  # (P,)
    ell_r = _per_token(rejected_logps.to(dtype), rejected_tokens)  # (P,)
    odds_c, clamped_c = _log_odds(ell_c)
    odds_r, clamped_r = _log_odds(ell_r)
    log_odds = odds_c - odds_r  # (P,)
    nll = -ell_c  # (P,)
    losses = nll - beta * F.logsigmoid(log_odds)  # (P,)
    return _out(
        losses,
        beta * ell_c,
        beta * ell_r,
        chosen_logps,
        rejected_logps,
        normalizer,
        nll=nll.detach(),
        log_odds=log_odds.detach(),
        orpo_clamped=clamped_c | clamped_r,
    )


def _log_odds(ell: Tensor) -> tuple[Tensor, Tensor]:
    """(log odds of e^ℓ, whether ℓ was clamped). log(−expm1(ℓ)) is log(1 − e^ℓ) without the
    cancellation 1 − e^ℓ suffers for ℓ near 0."""
    clamped = ell.detach() > ORPO_LOGP_MAX  # (P,)
    ell = ell.clamp(max=ORPO_LOGP_MAX)
    return ell - torch.log(-torch.expm1(ell)), clamped


def _out(
    losses: Tensor,
    chosen_reward: Tensor,
    rejected_reward: Tensor,
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    normalizer: float | None,
    **orpo: Tensor,
) -> PreferenceLossOut:
    denom = losses.numel() if normalizer is None else float(normalizer)
    assert denom > 0, normalizer
    return PreferenceLossOut(
        loss=losses.sum() / denom,
        losses=losses.detach(),
        chosen_reward=chosen_reward.detach(),
        rejected_reward=rejected_reward.detach(),
        chosen_logps=chosen_logps.detach().to(losses.dtype),
        rejected_logps=rejected_logps.detach().to(losses.dtype),
        **orpo,
    )


def _dtype(x: Tensor) -> torch.dtype:
    """float32 at least: bf16 and f16 inputs are promoted, float64 stays (gradcheck)."""
    return torch.promote_types(x.dtype, torch.float32)


def _per_token(x: Tensor, tokens: Tensor) -> Tensor:
    """x divided by each answer's trained tokens. NOTE: the data layer refuses an answer with
    no trained token; the clamp only keeps a stray 0 from dividing by zero."""
    return x / torch.as_tensor(tokens, device=x.device).to(x.dtype).clamp(min=1.0)
