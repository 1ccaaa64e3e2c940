"""One agentic trajectory as the rollout engine hands it on: the conversation, its turns and
how it ended, and its reward parts. The loop (algorithms/agent_grpo.py), `collect` and the
observe writer read these records; the tokens the loss trains live in the loop's Rollout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from retrograd.agent.scenarios import Scenario
from retrograd.agent.types import Verification

# How a trajectory ended. The first three are complete episodes; the rest are truncations
# (a limit cut it) except "failed" (the environment failed it: never trained, never written).
COMPLETE = ("no_tool_call", "done", "submitted")
TRUNCATIONS = ("max_turns", "max_failed_turns", "max_tokens", "deadline")
FINISHES = (*COMPLETE, *TRUNCATIONS, "failed")


@dataclass
class Turn:
    """One assistant turn and the answers to its calls."""

    text: str  # the sampled text, call markup included (what a raw record trains verbatim)
    content: str  # the prose with call markup removed
    calls: list[dict[str, Any]]  # [{"id", "name", "arguments": {...}}], in order
    valid: bool  # every call-shaped piece parsed and named a known tool
    n_tokens: int  # sampled tokens, stop token included
    observations: list[dict[str, Any]] = field(default_factory=list)  # tool messages


@dataclass
class Trajectory:
    scenario: Scenario
    member: int  # index in its group
    seed: int
    tools: list[dict[str, Any]]  # the catalog offered, OpenAI function shape
    messages: list[dict[str, Any]]  # tool-record shape (formats.md §1.4), structured turns
    turns: list[Turn] = field(default_factory=list)
    finish: str = "no_tool_call"  # one of FINISHES
    failure: str | None = None  # why the environment failed it
    step_rewards: list[float] = field(default_factory=list)
    final_reward: float | None = None  # verify's or the judge's; None while unscored
    verification: Verification | None = None
    summary: str | None = None  # the environment's terminal state (metadata.env.summary)
    generator: str = ""  # the model (file name) or API model that wrote it
    seconds: float = 0.0

    @property
    def truncated(self) -> bool:
        return self.finish in TRUNCATIONS

    @property
    def failed(self) -> bool:
        return self.finish == "failed"

    @property
    def complete(self) -> bool:
        return self.finish in COMPLETE

    @property
    def invalid_turns(self) -> int:
        return sum(not t.valid for t in self.turns)

    @property
    def n_tokens(self) -> int:
        """Tokens the policy wrote."""
        return sum(t.n_tokens for t in self.turns)

    @property
    def reward(self) -> float | None:
        """Final reward plus the step rewards (undiscounted); None while unscored."""
        if self.final_reward is None and not self.step_rewards:
            return None
        return (self.final_reward or 0.0) + sum(self.step_rewards)

    def raw_messages(self) -> list[dict[str, Any]]:
        """The conversation with every assistant turn as its sampled text (`"raw": true`)."""
        out, k = [], 0
        for m in self.messages:
            if m["role"] == "assistant":
                turn = self.turns[k]
                k += 1
                m = dict(m, content=turn.text, raw=True)
            out.append(m)
        return out
