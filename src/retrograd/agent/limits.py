"""What bounds one agentic trajectory: the [agent] keys read once, for the in-process rollouts
(agent/rollout.py) and the API ones (agent/api_rollout.py) alike. Knows no model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_turns: int = 6
    max_new_tokens_per_turn: int = 512  # in-process: a turn that does not stop is cut here
    max_trajectory_tokens: int = 4096  # in-process: the whole sequence, within [training].ctx
    max_rollout_secs: float = 300.0  # 0: no deadline
    end_on_no_tool_call: bool = True
    max_failed_turns: int = 0  # 0: never cut
    system_suffix: str = ""  # added to the scenario's system prompt
    temperature: float | None = None  # an API model's ([agent.collect_api]); None: its default

    @classmethod
    def of(cls, agent, ctx: int | None = None, temperature: float | None = None) -> Limits:
        """[agent]'s limits; ctx: the in-process model's context, which bounds a trajectory's
        tokens (None for an API model, whose context is its own)."""
        tokens = agent.max_trajectory_tokens or ctx or cls.max_trajectory_tokens
        return cls(
            agent.max_turns,
            agent.max_new_tokens_per_turn,
            min(tokens, ctx) if ctx else tokens,
            agent.max_rollout_secs,
            agent.end_on_no_tool_call,
            agent.max_failed_turns,
            agent.system_suffix,
            temperature,
        )

    @property
    def loss_budget(self) -> int:
        """The constant the loss divides a trajectory's token sum by (formats.md §4.4)."""
        return min(self.max_turns * self.max_new_tokens_per_turn, self.max_trajectory_tokens)
