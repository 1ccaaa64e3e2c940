"""Typed records of rollouts: what was sampled, how it was scored, what trained."""

from retrograd.rollout.records import SKIP_REASONS, Group, Rollout

__all__ = ["SKIP_REASONS", "Group", "Rollout"]
