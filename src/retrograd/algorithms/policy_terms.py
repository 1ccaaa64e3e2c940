"""The policy loss's terms and statistics over one optimizer pass of an update, summed over
its pieces (the forwards that score a few answers each) and then over the ranks: the
`policy/` metrics GRPO and PPO report (docs/metrics.md, "Rollout algorithms").

It reads the loss's outputs (losses/policy.py) and the rollout records; it knows nothing of
models, sinks or optimizers. The first pass of an update also keeps each answer's
log-probabilities as its old ones (`keep_old`): the ratios of later passes read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from retrograd.losses.policy import PolicyLossOut
from retrograd.observe import names
from retrograd.rollout import spread
from retrograd.rollout.records import Rollout

# the sums a pass adds up, piece by piece: loss terms (already over the update's tokens),
# clip shares (weighted by the piece's share), first-pass log-probability totals
_SUMS = ("loss", "surrogate", "kl", "clipped", "clipped_low", "clipped_high", "ratio", "gap", "nll")


@dataclass
class PolicyTerms:
    """One pass's accumulator. tokens: the update's trained tokens (the loss's normalizer);
    answers: its trained answers, the weight of sequence-level statistics (by_answer); first:
    the update's first pass, which keeps the old log-probabilities and alone reports the
    sampler gap and the entropy estimate (later passes leave them as the first one set them)."""

    tokens: float
    answers: int
    by_answer: bool = False
    first: bool = True
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_SUMS, 0.0))
    ratio_min: float = math.inf
    ratio_max: float = -math.inf

    def keep_old(self, batch: list[Rollout], lps: list[torch.Tensor]) -> None:
        """The first pass: each answer's log-probabilities become its old ones (the ratios are
        then exactly 1), and their distance to the sampler's and their sum are counted."""
        for r, lp in zip(batch, lps, strict=True):
            if r.old_logprobs is not None:
                continue
            r.old_logprobs = lp.detach().float().cpu().numpy().astype(np.float32)
            self.sums["gap"] += float(np.abs(r.old_logprobs - r.sampler_logprobs).sum())
            self.sums["nll"] -= float(r.old_logprobs.astype(np.float64).sum())

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
            **(first if self.first else {}),
        }
