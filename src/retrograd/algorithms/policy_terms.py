"""The policy loss's terms and statistics over one optimizer pass of an update, summed over
its pieces (the forwards that score a few answers each) and then over the ranks: the
`policy/` metrics the rollout loops report (docs/metrics.md, "Rollout algorithms"; each loop
reports its own list of them, algorithms/policy.py runs the passes).

It reads the loss's outputs (losses/policy.py) and the rollout records; it knows nothing of
models, sinks or optimizers. The first pass of an update also keeps each answer's
log-probabilities as its old ones (`keep_old`): the ratios of later passes read them. When the
sampler is not the trainer ([training].rollout_backend other than in_process), `corrected`
puts the truncated importance weights min(pi_old / pi_sampler, C) on each token's advantage
(losses/correction.py) and the pass reports their mean and truncated share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from retrograd.losses.correction import truncated_is_weights, weigh_advantages
from retrograd.losses.policy import PolicyLossOut
from retrograd.observe import names
from retrograd.rollout import spread
from retrograd.rollout.passes import padded
from retrograd.rollout.records import Rollout

# the sums a pass adds up, piece by piece: loss terms (already over the update's tokens),
# clip shares (weighted by the piece's share), first-pass log-probability totals
_SUMS = (
    "loss",
    "surrogate",
    "kl",
    "anchor_kl",
    "clipped",
    "clipped_low",
    "clipped_high",
    "ratio",
    "gap",
    "nll",
)
_IS_SUMS = ("is_weight", "is_truncated")  # the sampler's importance weights, token-weighted


def sampler_cap(training) -> float | None:
    """C of the truncated importance weights when the sampler is not the trainer
    ([training].rollout_backend other than in_process), else None: no correction."""
    return None if training.rollout_backend == "in_process" else training.rollout_is_cap


@dataclass
class PolicyTerms:
    """One pass's accumulator. tokens: the update's trained tokens (the loss's normalizer);
    answers: its trained answers, the weight of sequence-level statistics (by_answer); first:
    the update's first pass, which keeps the old log-probabilities and alone reports the
    sampler gap and the entropy estimate (later passes leave them as the first one set them).
    is_cap: `sampler_cap`, C of the importance weights `corrected` applies (None: none)."""

    tokens: float
    answers: int
    by_answer: bool = False
    first: bool = True
    is_cap: float | None = None
    anchor: bool = False  # PPO's KL term toward the reference is on: report it
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_SUMS + _IS_SUMS, 0.0))
    ratio_min: float = math.inf
    ratio_max: float = -math.inf

    def keep_old(self, batch: list[Rollout], lps: list[torch.Tensor], masked: bool = False) -> None:
        """The first pass: each answer's log-probabilities become its old ones (the ratios are
        then exactly 1), and their distance to the sampler's (over its token_mask's tokens
        when `masked`: an agent's own) and their sum are counted. An answer without the
        sampler's log-probabilities (a caller's own record) takes these."""
        for r, lp in zip(batch, lps, strict=True):
            if r.old_logprobs is not None:
                continue
            r.old_logprobs = lp.detach().float().cpu().numpy().astype(np.float32)
            if r.sampler_logprobs is None:  # a caller's record without them: the ratio 1
                r.sampler_logprobs = r.old_logprobs
            gap = np.abs(r.old_logprobs - r.sampler_logprobs)
            self.sums["gap"] += float((gap * r.token_mask if masked else gap).sum())
            self.sums["nll"] -= float(r.old_logprobs.astype(np.float64).sum())

    def corrected(
        self, batch: list[Rollout], adv: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """A piece's advantages (B,) or (B, T), each token's times its importance weight
        min(pi_old / pi_sampler, C) when the sampler is not the trainer (after `keep_old`);
        as they are otherwise."""
        if self.is_cap is None:
            return adv
        width = mask.shape[1]
        old = padded([r.old_logprobs for r in batch], width)
        behaviour = padded([r.sampler_logprobs for r in batch], width)
        w = truncated_is_weights(old, behaviour, mask.cpu(), self.is_cap)
        share = float(mask.sum()) / max(self.tokens, 1.0)
        self.sums["is_weight"] += w.mean * share
        self.sums["is_truncated"] += w.truncated * share
        return weigh_advantages(adv, w.w.to(adv.device))

    def add(self, out: PolicyLossOut, mask: torch.Tensor, n_answers: int) -> None:
        """One piece's loss: its terms (sums over the update's tokens) and its statistics,
        weighted by its share of the update's tokens (answers at sequence level)."""
        n = float(mask.sum())
        if self.by_answer:
            share = n_answers / max(self.answers, 1)
        else:
            share = n / max(self.tokens, 1.0)
        s = self.sums
        s["loss"] += float(out.loss.detach())
        s["surrogate"] += float(out.surrogate.detach())
        s["kl"] += float(out.kl.detach())
        s["anchor_kl"] += float(out.anchor_kl.detach())
        s["clipped"] += float(out.clip_fraction) * share
        s["clipped_low"] += float(out.clip_low_fraction) * share
        s["clipped_high"] += float(out.clip_high_fraction) * share
        s["ratio"] += float(out.ratio_mean) * share
        if n:
            self.ratio_min = min(self.ratio_min, float(out.ratio_min))
            self.ratio_max = max(self.ratio_max, float(out.ratio_max))

    def metrics(self, world) -> dict[str, float]:
        """The pass's metrics, summed (extremes taken) over the ranks."""
        s = spread.total(self.sums, world)
        ends = spread.everyone([(self.ratio_min, self.ratio_max)], world)
        lo, hi = min(e[0] for e in ends), max(e[1] for e in ends)
        tokens = max(self.tokens, 1.0)
        first = {names.SAMPLER_LOGPROB_GAP: s["gap"] / tokens, names.ENTROPY: s["nll"] / tokens}
        anchor = {names.REFERENCE_KL: s["anchor_kl"]} if self.anchor else {}
        if self.is_cap is not None:
            first[names.SAMPLER_IS_WEIGHT_MEAN] = s["is_weight"]
            first[names.SAMPLER_IS_TRUNCATED] = s["is_truncated"]
        return {
            names.TOTAL_LOSS: s["loss"],
            names.TRAIN_LOSS: s["loss"],
            names.SURROGATE_LOSS: s["surrogate"],
            names.POLICY_KL: s["kl"],
            names.CLIP_FRACTION: s["clipped"],
            names.CLIP_LOW_FRACTION: s["clipped_low"],
            names.CLIP_HIGH_FRACTION: s["clipped_high"],
            names.RATIO_MEAN: s["ratio"],
            names.RATIO_MIN: lo if math.isfinite(lo) else 1.0,
            names.RATIO_MAX: hi if math.isfinite(hi) else 1.0,
            **anchor,
            **(first if self.first else {}),
        }
