"""PPO's critic side: GAE advantages, their whitening, and the value head's loss; pure
functions of per-token tensors.

They know nothing about models or rollout records. The caller passes padded (B, T) tensors
whose mask is 1 on each answer's tokens (a prefix of its row) and 0 on padding. The variant
(rl-math.md §3.8; the spec wins where they differ):

- GAE over an answer's tokens, backwards: δ_t = r_t + γ V_{t+1} − V_t, Â_t = δ_t + γλ Â_{t+1},
  with V = 0 after the last token (the answer ends the episode); returns R_t = Â_t + V_t are
  the value targets (TRL's PPO, verl's compute_gae_advantage_return).
- Whitening over the batch's trained tokens: mean 0, unit variance (TRL's `whiten`, without
  its shift-back). A batch whose advantages are all equal carries no signal: all zeros.
- Explained variance 1 − Var(R − V) / Var(R) over the mask's positions (verl's
  critic/vf_explained_var), of the values the head gave before it trained on the batch: 1 for
  a head that predicts every return, 0 for one no better than the batch's mean, below 0 for
  one that adds noise.
- Value loss ½ · Σ m (V − R)² / N, the token mean over the batch. No value clipping (verl's
  cliprange_value): the spec has no key for it, and the head trains on stored features with
  its own optimizer, so it cannot drag the policy along.
"""

from __future__ import annotations

import torch
from torch import Tensor

WHITEN_EPS = 1e-8


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """rewards, values, mask: (B, T) -> (advantages, returns), each (B, T), 0 off the mask.

    rewards holds each token's reward (an answer's score on its last token, 0 elsewhere);
    values V_t the critic's estimate of the state before token t. Computed in float64."""
    m = mask.to(torch.float64)  # (B, T)
    r = torch.where(mask.bool(), rewards.to(torch.float64), 0.0)  # (B, T)
    v = torch.where(mask.bool(), values.to(torch.float64), 0.0)  # (B, T)
    adv = torch.zeros_like(r)  # (B, T)
    running = torch.zeros(r.shape[0], dtype=torch.float64, device=r.device)  # (B,)
    next_value = torch.zeros_like(running)  # (B,)
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        running = (delta + gamma * lam * running) * m[:, t]  # padding resets: 0 after the end
        adv[:, t] = running
        next_value = v[:, t] * m[:, t]
    return adv, (adv + v) * m


def whiten(x: Tensor, mask: Tensor) -> Tensor:
    """x (B, T) -> (x − mean) / std over the mask's positions (population std), 0 off the
    mask; all zeros where x is constant over the mask (no signal)."""
    keep = mask.bool()
    vals = x[keep].to(torch.float64)
    if vals.numel() == 0:
        return torch.zeros_like(x)
    mean = vals.mean()
    std = ((vals - mean) ** 2).mean().sqrt()
    if std <= WHITEN_EPS * max(1.0, float(mean.abs())):
        return torch.zeros_like(x)
    out = (x.to(torch.float64) - mean) / std
    return torch.where(keep, out, 0.0).to(x.dtype)


def value_loss(values: Tensor, returns: Tensor, mask: Tensor, normalizer: float | None = None):
    """½ Σ m (V − R)² / N: values (B, T) with gradient, returns (B, T) targets, N the trained
    tokens (default mask.sum()). Float32 at least."""
    dtype = torch.promote_types(values.dtype, torch.float32)
    keep = mask.bool()
    err = torch.where(keep, values.to(dtype) - returns.to(dtype), torch.zeros((), dtype=dtype))
    denom = keep.sum().clamp(min=1) if normalizer is None else float(normalizer)
    return 0.5 * (err * err).sum() / denom


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 − Var(R − V) / Var(R) over the mask's positions (population variances, float64);
    NaN where the returns do not vary (nothing to explain)."""
    keep = mask.bool()
    v, r = values[keep].to(torch.float64), returns[keep].to(torch.float64)
    if r.numel() == 0:
        return float("nan")
    var_r = ((r - r.mean()) ** 2).mean()
    if var_r <= WHITEN_EPS:
        return float("nan")
    err = r - v
    return float(1.0 - ((err - err.mean()) ** 2).mean() / var_r)
