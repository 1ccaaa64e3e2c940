"""Group advantages and reward shaping over rollout records (numpy; no torch, no model).

It owns what happens to a group's rewards between scoring and the loss: the overlong penalty,
the group baseline, which answers leave the loss and why, and the KL coefficient's schedule.
It does not know how rewards were computed or how the loss reads the advantages: the loss
takes `Rollout.advantage` of the answers still `eligible`. Decisions (rl-math.md §3.1, 3.4,
3.5; the spec wins over the peers):

- Advantage = reward − baseline, with no division by the group's standard deviation (Dr.
  GRPO; TRL scale_rewards="none", verl norm_adv_by_std_in_grpo=False). The spec's only
  advantage key is `baseline` (mean | leave_one_out), no scaling key; leave_one_out is RLOO,
  which is unscaled; dividing by std weighs near-unanimous groups most (Dr. GRPO's bias) and
  would rescale max_penalty and judge_weight, which the spec gives in reward units.
- A group whose rewards are all equal (1e-9 relative) carries no signal: its answers get
  advantage 0 and skip_reason "zero_signal" (they would add a zero gradient and dilute the
  token-mean). The tolerance keeps a float sum like 0.1 + 0.2 − 0.3 from posing as signal.
- Truncated answers stay in their group's baseline (their reward is real) and, with
  mask_truncated, leave the loss (TRL's mask_truncated_completions; DAPO's overlong filter).
- Every part of a reward is finite (the reward program's replies are checked), but their sum
  or a group's mean can still overflow float64: that is a RewardError naming the update and
  group, not a NaN loss an update later.
- The KL coefficient ramps up linearly over warmup_updates, then, with a target, adapts once
  per update as in Ziegler et al. and verl (see KlController).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from retrograd.errors import RewardError
from retrograd.rollout.records import Group

# Answers whose reward does not enter their group's baseline (set before advantages).
NOT_IN_BASELINE = ("judge_dropped", "unscored", "update_skipped")
ZERO_SIGNAL_RTOL = 1e-9


def _mean_baseline(r: np.ndarray) -> np.ndarray:
    return r - r.mean()


def _leave_one_out(r: np.ndarray) -> np.ndarray:
    """r_i − mean of the others = G/(G−1) · (r_i − mean)."""
    assert r.size >= 2, "leave_one_out needs two answers"
    return r - (r.sum() - r) / (r.size - 1)


# [grpo].baseline -> advantages of one group's rewards.
BASELINES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "mean": _mean_baseline,
    "leave_one_out": _leave_one_out,
}


def group_advantages(rewards: np.ndarray, baseline: str = "mean") -> np.ndarray:
    """One group's advantages (float64): r − mean, or r − mean of the others (RLOO). Not
    divided by the standard deviation (module docstring)."""
    if baseline not in BASELINES:
        raise ValueError(f"baseline {baseline!r}: must be one of {list(BASELINES)}")
    return BASELINES[baseline](np.asarray(rewards, dtype=np.float64))


def zero_signal(rewards: np.ndarray) -> bool:
    """True when the rewards are all equal within 1e-9 of the largest magnitude (or fewer
    than two): no answer is better than another."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.size < 2:
        return True
    return bool(np.ptp(r) <= ZERO_SIGNAL_RTOL * np.abs(r).max())


def overlong_penalty(
    n_tokens: int, max_new_tokens: int, buffer_tokens: int, max_penalty: float
) -> float:
    """The amount subtracted from a reward (≥ 0): DAPO's soft overlong punishment scaled to
    max_penalty. 0 up to max_new_tokens − buffer_tokens, rising linearly to max_penalty at
    max_new_tokens (the stop token counts: an answer that fills the budget gets all of it)."""
    start = max_new_tokens - buffer_tokens
    return max_penalty * min(1.0, max(0.0, (n_tokens - start) / buffer_tokens))


def apply_overlong_penalty(
    groups: Iterable[Group], max_new_tokens: int, buffer_tokens: int, max_penalty: float
) -> None:
    """Sets Rollout.penalty of every answer ([grpo.overlong_penalty])."""
    for g in groups:
        for r in g.members:
            r.penalty = overlong_penalty(r.n_tokens, max_new_tokens, buffer_tokens, max_penalty)


@np.errstate(over="ignore", invalid="ignore")  # overflow is named (_refuse_overflow)
def assign_advantages(
    groups: list[Group],
    baseline: str,
    mask_truncated: bool,
    not_in_baseline: tuple[str, ...] = NOT_IN_BASELINE,
) -> dict:
    """Sets Rollout.advantage and skip_reason of every answer; returns the batch statistics
    (formats.md §7.2 batch/...): zero_std_group_fraction over the groups with scores,
    advantage_abs_mean and advantage_std (population) over the answers that train,
    trained_fraction over all answers.

    Answers already skipped for judge_dropped, unscored or update_skipped (`not_in_baseline`:
    agentic GRPO adds truncated), and answers without a reward (marked unscored here), are
    left out of the baseline. Raises RewardError when a reward, or its group's arithmetic,
    is not finite (each part was: their sum overflowed)."""
    scored_groups = zero_groups = 0
    for g in groups:
        for r in g.members:
            r.advantage = 0.0
            if r.reward is None:
                r.skip_reason = r.skip_reason or "unscored"
        scored = [r for r in g.members if r.skip_reason not in not_in_baseline]
        if not scored:
            continue
        scored_groups += 1
        rewards = np.array([r.reward for r in scored], dtype=np.float64)
        if not np.isfinite(rewards).all():
            _refuse_overflow(g, scored, rewards)
        if zero_signal(rewards):
            zero_groups += 1
            g.skip("zero_signal")
            continue
        advantages = group_advantages(rewards, baseline)
        if not np.isfinite(advantages).all():  # finite rewards whose sum overflows float64
            raise RewardError(
                f"update {g.update}, group {g.index}: the rewards {rewards.tolist()} overflow "
                f"their group's mean: scale the rewards down"
            )
        for r, adv in zip(scored, advantages, strict=True):
            r.advantage = float(adv)
            if mask_truncated and r.truncated:
                r.skip_reason = r.skip_reason or "truncated"
    members = [r for g in groups for r in g.members]
    trained = [r.advantage for r in members if r.eligible]
    return {
        "zero_std_group_fraction": zero_groups / scored_groups if scored_groups else 0.0,
        "advantage_abs_mean": float(np.mean(np.abs(trained))) if trained else 0.0,
        "advantage_std": float(np.std(trained)) if trained else 0.0,
        "trained_fraction": len(trained) / len(members) if members else 0.0,
    }


def _refuse_overflow(g: Group, scored: list, rewards: np.ndarray) -> None:
    """Raises RewardError naming the first answer whose reward (the program's, plus the judge's
    term, minus the overlong penalty: each finite) overflowed to inf or NaN."""
    for r, value in zip(scored, rewards, strict=True):
        if not math.isfinite(value):
            raise RewardError(
                f"update {g.update}, group {g.index}, answer {r.member}: the reward is {value} "
                f"(the program's {r.reward_raw!r} + the judge's term {r.judge_term!r} - the "
                f"overlong penalty {r.penalty!r}): scale the rewards or judge_weight down"
            )


KL_HORIZON_UPDATES = 10.0
"""Horizon of the adaptive KL controller, in updates: β moves at most 0.2 / 10 = 2% per update,
the step verl's defaults take (horizon 10,000 answers, about 1,000 answers a step), whatever
the batch size. Ziegler's n/horizon counts answers; ours counts updates because one KL is
measured per update, and a run of a hundred updates must be able to move β several-fold."""
KL_ERROR_CLIP = 0.2


class KlController:
    """The KL coefficient of each update: [grpo].kl_coefficient ramped up linearly over
    [grpo.kl_schedule].warmup_updates (update u gets min(1, u / warmup) of it, like the learning
    rate's warm-up), then, with a target, adapted after every update from the KL it measured:
    β ← β · (1 + clip(KL / target − 1, −0.2, 0.2) / horizon). Adaptation starts with the first
    update run at the full coefficient; each update is observed once (a replay after resume is
    ignored). Updates are numbered from 1."""

    def __init__(
        self,
        coefficient: float,
        warmup_updates: int = 0,
        target: float | None = None,
        horizon: float = KL_HORIZON_UPDATES,
    ):
        assert coefficient >= 0 and warmup_updates >= 0 and horizon > 0
        assert target is None or target > 0, target
        self.coefficient = float(coefficient)  # before the warm-up ramp
        self.warmup_updates = warmup_updates
        self.target = target
        self.horizon = horizon
        self.last_update = 0  # the last update observed

    @classmethod
    def from_section(cls, grpo: Any) -> KlController:
        """From a [grpo] section (GrpoSection): kl_coefficient and [grpo.kl_schedule]."""
        schedule = grpo.kl_schedule
        if schedule is None:
            return cls(grpo.kl_coefficient)
        return cls(grpo.kl_coefficient, schedule.warmup_updates, schedule.target)

    def value(self, update: int) -> float:
        """The coefficient update `update` trains with."""
        if self.warmup_updates and update < self.warmup_updates:
            return self.coefficient * max(0, update) / self.warmup_updates
        return self.coefficient

    def observe(self, kl: float, update: int) -> None:
        """Adapts the coefficient to the KL measured while training update `update`."""
        if update <= self.last_update:
            return
        self.last_update = update
        if self.target is None or update < self.warmup_updates:
            return
        assert math.isfinite(kl), kl
        error = min(KL_ERROR_CLIP, max(-KL_ERROR_CLIP, kl / self.target - 1.0))
        self.coefficient *= 1.0 + error / self.horizon

    def state_dict(self) -> dict:
        """What a checkpoint keeps: plain JSON values."""
        return {"coefficient": self.coefficient, "last_update": self.last_update}

    def load_state_dict(self, state: dict) -> None:
        self.coefficient = float(state["coefficient"])
        self.last_update = int(state["last_update"])
