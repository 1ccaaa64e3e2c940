"""An update's answers as metrics (docs/metrics.md, "Rollout algorithms"): their rewards, their
lengths, and what the advantages made of them. Each rollout loop reports the parts that apply
to it under the names of observe/names.py. Knows the records, not the loops.
"""

from __future__ import annotations

import numpy as np

from retrograd.observe import names
from retrograd.rollout.records import Group, Rollout


def reward_metrics(answers: list[Rollout]) -> dict[str, float]:
    """The answers' rewards (after shaping): mean, lowest, highest, spread."""
    rewards = np.array([r.reward for r in answers], dtype=np.float64)
    return {
        names.REWARD_MEAN: float(rewards.mean()),
        names.REWARD_MIN: float(rewards.min()),
        names.REWARD_MAX: float(rewards.max()),
        names.REWARD_STD: float(rewards.std()),
    }


def group_metrics(groups: list[Group]) -> dict[str, float]:
    """The groups' own spread of rewards, and the verifiable part of the reward (before a
    judge's term and the penalties)."""
    raw = np.array([r.reward_raw for g in groups for r in g.members], dtype=np.float64)
    return {
        names.REWARD_GROUP_STD: float(np.mean([float(np.std(g.rewards)) for g in groups])),
        names.REWARD_VERIFIABLE_MEAN: float(raw.mean()),
    }


def answer_metrics(answers: list[Rollout]) -> dict[str, float]:
    """The answers' lengths in tokens, and the share cut at max_new_tokens."""
    lengths = np.array([r.n_tokens for r in answers], dtype=np.float64)
    return {
        names.LENGTH_MEAN: float(lengths.mean()),
        names.LENGTH_MIN: float(lengths.min()),
        names.LENGTH_MAX: float(lengths.max()),
        names.TRUNCATION_FRACTION: float(np.mean([r.truncated for r in answers])),
    }


def advantage_metrics(stats: dict) -> dict[str, float]:
    """rollout.shaping.assign_advantages's statistics, by their metric names."""
    return {
        names.ZERO_STD_GROUP_FRACTION: stats["zero_std_group_fraction"],
        names.ADVANTAGE_ABS_MEAN: stats["advantage_abs_mean"],
        names.ADVANTAGE_STD: stats["advantage_std"],
        names.TRAINED_FRACTION: stats["trained_fraction"],
    }
