"""Rewards from outside programs: reward programs (persistent or oneshot) and the command judge.

No torch here: the GRPO and PPO loops hand in strings and get numbers back (docs/rewards.md).
"""

from retrograd.rewards.judge import CommandJudge, command_judge, judge_request
from retrograd.rewards.program import RewardProgram, RewardReply, RewardRequest, reward_program

__all__ = [
    "CommandJudge",
    "RewardProgram",
    "RewardReply",
    "RewardRequest",
    "command_judge",
    "judge_request",
    "reward_program",
]
