"""The correction for a sampler that is not the trainer: truncated importance weights.

When answers are sampled by another engine (llama.cpp's arithmetic, a quantized file, an f16
cache) the behaviour policy μ differs a little from the trainer's own π_old, and the clipped
surrogate, which treats the answers as drawn from π_old, is biased. The correction (TRL's
vllm_importance_sampling_correction in its token_truncate mode, verl's token-level rollout
correction with rollout_is_threshold; rl-math.md §3.9) weighs each token's surrogate term by

    w_t = min(π_old(y_t) / μ(y_t), C) = min(exp(log π_old − log μ), C),

detached (a constant of the loss), truncated at C so a token the sampler found unlikely cannot
dominate the update. Every w_t > 0, so it scales a token's advantage: −min(ρ·wA, clip(ρ)·wA) is
w·(−min(ρA, clip(ρ)A)), which is how the loops apply it (policy_loss takes per-token
advantages); the KL term is not weighted (as TRL). Pure functions of tensors: nothing about
models, samplers or records.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from retrograd.losses.policy import LOG_RATIO_LIMIT


@dataclass(frozen=True)
class Weights:
    """w (B, T) float32, 0 off the mask; mean: the mean w over the trained tokens; truncated:
    the share of trained tokens whose weight the cap cut."""

    w: Tensor
    mean: float
    truncated: float


def truncated_is_weights(
    old_logp: Tensor, sampler_logp: Tensor, mask: Tensor, cap: float
) -> Weights:
    """old_logp: the trainer's log π_old of the sampled tokens (B, T); sampler_logp: the
    sampler's log μ of the same tokens (B, T); mask: the trained tokens (B, T); cap: C ≥ 1.
    Positions off the mask may hold anything (even NaN): their weight is 0."""
    if not cap >= 1.0:
        raise ValueError(f"the importance-weight cap {cap} must be at least 1")
    keep = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=old_logp.device)
    diff = torch.where(keep, old_logp.float() - sampler_logp.float(), zero)  # (B, T)
    raw = torch.exp(diff.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))  # (B, T)
    w = torch.where(keep, raw.clamp(max=cap), zero).detach()  # (B, T)
    n = int(keep.sum())
    if n == 0:
        return Weights(w, 1.0, 0.0)
    return Weights(w, float(w[keep].mean()), float((raw[keep] > cap).float().mean()))


def weigh_advantages(advantages: Tensor, w: Tensor) -> Tensor:
    """Per-answer (B,) or per-token (B, T) advantages -> per-token advantages (B, T) times w."""
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    return adv.to(w.dtype) * w
