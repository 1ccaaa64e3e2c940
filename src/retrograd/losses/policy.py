"""The clipped policy-gradient loss of GRPO, PPO, on-policy distillation and agentic GRPO: a
pure function of per-token log-probabilities.

It knows nothing about models, tokenizers or rollout records. The caller scores the sampled
tokens under the policy being trained (`logp`, with gradient), under the policy that sampled
them (`old_logp`) and, with a KL term, under the reference (`ref_logp`); it passes one
advantage per answer (or per token) and a mask of the tokens that train. The variant, where the
spec and the peers differ (rl-math.md §3.1-3.4; the spec wins):

- Clipped surrogate with two clip ranges (DAPO's clip-higher): the spec's clip_range_low /
  clip_range_high, ℓ = −min(ρA, clip(ρ, 1 − low, 1 + high)A). No dual clip (verl's
  clip_ratio_c), no INTELLECT-2 delta: the spec has no key for them.
- importance_sampling_level, the spec's "token or sequence": token is PPO/GRPO's per-token
  ratio ρ_t = π/π_old; sequence is GSPO's length-normalised ratio s = exp(mean_t log ρ_t), in
  the GSPO-token form of verl and Tinker, s_t = sg[s] · π_t / sg[π_t]: the same value on every
  token of an answer, and every token gets s·A·∇log π_t, so per-token advantages still work.
- KL toward the reference: Schulman's k3 per token, e^x − x − 1 with x = log π_ref − log π,
  added to the loss as kl_coef · k3 (TRL GRPO), not subtracted from the reward, but with k2's
  gradient (verl's "k3+"): on the policy's samples k3's own gradient, (1 − π_ref/π)∇log π, is
  in expectation that of KL(π_ref ‖ π), weighted by π_ref/π, unbounded where the policy has
  made a token the reference likes rare; k2's, −x ∇log π, is in expectation that of
  KL(π ‖ π_ref), the divergence k3's value estimates.
- Two KL terms at once (PPO): `ref_logp` with `kl_coef` is the one KL term of GRPO, agentic
  GRPO and distillation, and PPO's toward the policy that sampled the batch (the spec's
  kl_coefficient); `anchor_logp` with `anchor_coef` is a second one of the same form, PPO's
  reference_kl_coefficient toward the reference (TRL's PPO penalises KL to the reference as a
  per-token reward; here it is the same k3-valued, k2-gradient term GRPO adds to its loss).
- Aggregation: the DAPO token-mean Σ m·ℓ / N (TRL's "dapo", verl's "token-mean"), with N the
  trained tokens of the whole update: a caller that cuts an update into micro-batches passes
  the update's count as `normalizer`, so the pieces' gradients sum to the whole's. Departure
  from the GSPO paper: at sequence level too the mean is over tokens, not over answers, so a
  long answer weighs more (as LUSPO); the two levels then differ only in their ratio.

NOTE: log-ratios are clamped to ±20 before exp (verl does the same) so a token the policy has
moved far from cannot overflow float32; the clamp is flat there, so that token's gradient is 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

LOG_RATIO_LIMIT = 20.0  # e^20 ≈ 4.9e8: far past any clip range, far below float32's max


@dataclass(frozen=True)
class PolicyLossOut:
    """Scalars; loss = surrogate + kl_coef · kl + anchor_coef · anchor_kl. loss, surrogate,
    kl and anchor_kl carry the graph (all divided by the same normalizer, so micro-batches'
    values sum to the update's); the statistics are detached means over this call's trained
    tokens (or answers)."""

    loss: Tensor
    surrogate: Tensor
    kl: Tensor
    anchor_kl: Tensor  # toward anchor_logp (0 without one)
    clip_fraction: Tensor  # share of trained tokens (answers at sequence level) clipped
    ratio_mean: Tensor  # mean ρ over trained tokens, or mean s over answers
    clip_low_fraction: Tensor  # the part of clip_fraction below 1 − clip_low (advantage < 0)
    clip_high_fraction: Tensor  # the part above 1 + clip_high (advantage > 0)
    ratio_min: Tensor  # the extremes of ρ over the trained tokens (1 where none train)
    ratio_max: Tensor


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    level: str = "token",
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    anchor_logp: Tensor | None = None,
    anchor_coef: float = 0.0,
    normalizer: float | None = None,
) -> PolicyLossOut:
    """logp, old_logp, ref_logp, anchor_logp, mask: (B, T), padded; advantages: (B,) per
    answer or (B, T).

    normalizer: the token count the sums are divided by; default the trained tokens of this
    call (mask.sum()). Computed in float32 at least: bf16 and f16 inputs are promoted, float64
    stays float64 (gradcheck). Positions off the mask may hold anything, even NaN: they get
    neither value nor gradient."""
    assert 0 < clip_low < 1 and clip_high > 0, (clip_low, clip_high)
    if level not in IS_LEVELS:
        raise ValueError(f"importance sampling level {level!r}: must be one of {list(IS_LEVELS)}")
    if kl_coef and ref_logp is None:
        raise ValueError("kl_coef > 0 needs ref_logp")
    if anchor_coef and anchor_logp is None:
        raise ValueError("anchor_coef > 0 needs anchor_logp")
    dtype = torch.promote_types(logp.dtype, torch.float32)
    keep = mask.bool()  # (B, T)
    m = keep.to(dtype)  # (B, T)
    logp = _masked(logp, keep, dtype)  # (B, T)
    adv = advantages.to(dtype)
    adv = adv[:, None] if adv.dim() == 1 else _masked(adv, keep, dtype)  # (B, 1) or (B, T)
    denom = m.sum().clamp(min=1.0) if normalizer is None else float(normalizer)
    assert denom > 0, normalizer

    log_ratio = logp - _masked(old_logp, keep, dtype)  # (B, T), 0 off the mask
    ratio_of, by_answer = IS_LEVELS[level]
    ratio = ratio_of(logp, log_ratio, m)  # (B, T)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    per_token = -torch.minimum(ratio * adv, clipped * adv)  # (B, T)
    surrogate = (per_token * m).sum() / denom

    if ref_logp is None:
        kl = surrogate.new_zeros(())
    else:
        kl = (kl_term(logp, _masked(ref_logp, keep, dtype)) * m).sum() / denom
    if anchor_logp is None:
        anchor_kl = surrogate.new_zeros(())
    else:
        anchor_kl = (kl_term(logp, _masked(anchor_logp, keep, dtype)) * m).sum() / denom
    # Clipped where the clip's flat side is the one taken: the token gets no gradient.
    high = (ratio > 1.0 + clip_high) & (adv > 0)  # (B, T)
    low = (ratio < 1.0 - clip_low) & (adv < 0)  # (B, T)
    r = ratio.detach()
    return PolicyLossOut(
        loss=surrogate + kl_coef * kl + anchor_coef * anchor_kl,
        surrogate=surrogate,
        kl=kl,
        anchor_kl=anchor_kl,
        clip_fraction=_stat_mean((high | low).to(dtype), m, by_answer),
        ratio_mean=_stat_mean(r, m, by_answer),
        clip_low_fraction=_stat_mean(low.to(dtype), m, by_answer),
        clip_high_fraction=_stat_mean(high.to(dtype), m, by_answer),
        ratio_min=r[keep].min() if keep.any() else r.new_ones(()),
        ratio_max=r[keep].max() if keep.any() else r.new_ones(()),
    )


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(π‖π_ref) from the sampled tokens' log-probabilities:
    e^x − x − 1 with x = ref_logp − logp; ≥ 0, and 0 where the two agree."""
    x = (ref_logp - logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.exp(x) - x - 1.0


def kl_term(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per token: k3's value with k2's gradient, k3 + (k2 − sg[k2]) with k2 = x² / 2; on the
    policy's own samples the expected gradient is that of KL(π ‖ π_ref)."""
    k2 = 0.5 * (logp - ref_logp) ** 2
    return kl_k3(logp, ref_logp).detach() + (k2 - k2.detach())


def _token_ratio(logp: Tensor, log_ratio: Tensor, m: Tensor) -> Tensor:
    """ρ_t = π_t / π_old,t per token."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))  # (B, T)


def _sequence_ratio(logp: Tensor, log_ratio: Tensor, m: Tensor) -> Tensor:
    """GSPO-token: s = exp(mean_t log ρ_t) per answer, spread over its tokens as
    sg[s] · exp(logp − sg[logp]): the value s, the gradient s · ∇logp_t on each token."""
    n = m.sum(-1).clamp(min=1.0)  # (B,)
    log_s = (log_ratio * m).sum(-1) / n  # (B,)
    s = torch.exp(log_s.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))  # (B,)
    return s.detach()[:, None] * torch.exp(logp - logp.detach())  # (B, T)


# importance_sampling_level -> (the ratio each token's surrogate reads, whether the statistics
# average per answer first).
IS_LEVELS: dict[str, tuple[Callable[[Tensor, Tensor, Tensor], Tensor], bool]] = {
    "token": (_token_ratio, False),
    "sequence": (_sequence_ratio, True),
}


def _masked(x: Tensor, keep: Tensor, dtype: torch.dtype) -> Tensor:
    """x in `dtype` with 0 off the mask, so padding (even NaN) reaches no value or gradient."""
    return torch.where(keep, x.to(dtype), torch.zeros((), dtype=dtype, device=x.device))


def _stat_mean(x: Tensor, m: Tensor, by_answer: bool) -> Tensor:
    """Mean of x over trained tokens; by_answer: per answer first, then over answers."""
    if not by_answer:
        return (x * m).sum() / m.sum().clamp(min=1.0)
    n = m.sum(-1)  # (B,)
    rows = n > 0
    per_answer = (x * m).sum(-1)[rows] / n[rows]  # (answers,)
    return per_answer.mean() if per_answer.numel() else x.new_zeros(())
