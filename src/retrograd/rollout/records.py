"""The records of a rollout algorithm (GRPO, PPO, on-policy distillation, agentic GRPO).

One `Rollout` per sampled answer carries everything the loop computes about it, in the order
the loop computes it: the sampled ids and the sampler's log-probabilities, the reward parts,
the advantage, whether it trains and why not. The loss, the metrics and the observe writer all
read these records, so none of them needs another's bookkeeping. No torch at module level:
per-token values are numpy arrays (float32), cheap to log and to checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from retrograd.data.prompts import Prompt

# Why an answer does not train (formats.md §6): cut at the token budget with mask_truncated,
# its group carries no signal, the judge dropped its group, it was never scored, or the whole
# update was skipped.
SKIP_REASONS = ("truncated", "zero_signal", "judge_dropped", "unscored", "update_skipped")


@dataclass
class Rollout:
    """One sampled answer to a prompt, and what became of it."""

    prompt: Prompt
    update: int  # numbered from 1
    group: int  # the group's index in its update
    member: int  # the answer's index in its group
    seed: int  # its sampling seed (seeds.derive_seed)
    ids: tuple[int, ...]  # the answer's ids, its stop token included when it stopped on one
    text: str  # the answer's text, stop token excluded
    truncated: bool  # cut at max_new_tokens
    sampler_logprobs: np.ndarray  # (len(ids),) float32: what the sampler computed
    old_logprobs: np.ndarray | None = None  # re-scored on the training path before the update
    ref_logprobs: np.ndarray | None = None  # under the reference model, when KL is on
    teacher_logprobs: np.ndarray | None = None  # under the teacher (on-policy distillation)
    token_advantages: np.ndarray | None = None  # per token, when the advantage is per token
    token_mask: np.ndarray | None = None  # 1 on the tokens that train (agentic: the policy's)
    reward_raw: float | None = None  # the reward program's number
    judge_term: float | None = None  # judge_weight x verdict, with a judge
    penalty: float = 0.0  # the overlong penalty subtracted
    advantage: float = 0.0
    skip_reason: str | None = None  # one of SKIP_REASONS, or None when it trains
    trained: bool | None = None  # set after the update: True when it was in the loss
    extra: dict = field(default_factory=dict)

    @property
    def reward(self) -> float | None:
        """The reward the advantage reads: the program's, plus the judge's term, minus the
        overlong penalty; None while unscored."""
        if self.reward_raw is None:
            return None
        return self.reward_raw + (self.judge_term or 0.0) - self.penalty

    @property
    def n_tokens(self) -> int:
        return len(self.ids)

    @property
    def eligible(self) -> bool:
        return self.skip_reason is None


@dataclass
class Group:
    """The answers to one prompt in one update."""

    prompt: Prompt
    update: int
    index: int
    members: list[Rollout]

    @property
    def rewards(self) -> np.ndarray:
        return np.array([r.reward for r in self.members], dtype=np.float64)

    def skip(self, reason: str) -> None:
        """Every answer of the group leaves the loss for `reason` (kept where already set)."""
        assert reason in SKIP_REASONS, reason
        for r in self.members:
            r.skip_reason = r.skip_reason or reason
