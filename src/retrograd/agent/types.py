"""The interfaces between agentic rollouts and the world they act in (formats.md §4).

A trajectory owns one `Episode`: opened (created and reset) by its `Environment` for a
scenario and a seed, stepped with the policy's tool calls, verified and summarised at the end,
and closed whatever happens. Tool-level failures (a bad argument, a command that exits 1) are
observations with `is_error`; failures of the environment itself (set-up failed, a tool
replied garbage, the server vanished) raise `EnvironmentFailure` and drop the trajectory.

Observation text is deterministic: no ids, paths, pids or timings, listings sorted, so that two
trajectories doing the same thing see the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from retrograd.text import as_text

ERROR_PREFIX = "ERROR: "  # what the model sees before a failed call's observation
QUOTE_LIMIT = 200  # characters of a model-written string that an error observation repeats


def finite(value: Any) -> bool:
    """True for a JSON number that is a finite float (an integer of 400 digits is not; a
    boolean is no number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def quoted(value: str) -> str:
    """A model-written string (a path, a tool's name) as an error observation repeats it:
    whole up to QUOTE_LIMIT characters, else its head and the count of the rest."""
    if len(value) <= QUOTE_LIMIT:
        return value
    return f"{value[:QUOTE_LIMIT]}… [{len(value) - QUOTE_LIMIT} more characters]"


@dataclass(frozen=True)
class ToolSpec:
    """What the model sees of a tool: its exposed name, description and argument schema."""

    name: str
    description: str
    input_schema: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """The OpenAI function shape a chat template and a tool record take."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.input_schema,
            },
        }


def catalog_hash(specs: list[ToolSpec], ids: list[str] | None = None) -> str:
    """sha256 of a catalog (names, descriptions, schemas, and tool ids@versions when given),
    order-independent: what `tools list` prints and the resume signature holds."""
    rows = sorted(
        json.dumps([s.name, s.description, s.input_schema], sort_keys=True) for s in specs
    )
    payload = json.dumps({"tools": rows, "ids": sorted(ids or [])}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


@dataclass(frozen=True)
class Observation:
    """The answer to one tool call. `reward`: a step reward (undiscounted, added to the
    trajectory's); `done`: the episode is over (verify runs), which is not a truncation.
    `content` is always text: a lone surrogate (from a server's JSON, or an argument a tool
    repeats) is made U+FFFD here, so that nothing downstream fails to encode it."""

    content: str
    is_error: bool = False
    reward: float | None = None
    done: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.content, str):
            object.__setattr__(self, "content", as_text(self.content))

    def text(self) -> str:
        """The tool message's content as the model sees it."""
        return ERROR_PREFIX + self.content if self.is_error else self.content


@dataclass(frozen=True)
class Verification:
    """The environment's verdict on a finished trajectory: `reward` enters its final reward;
    `passed` is what collect's --require-verified keeps; `output` is shown in observe."""

    reward: float
    passed: bool
    output: str = ""


@dataclass(frozen=True)
class ExecResult:
    """One command in a sandbox. exit_code None: killed by a signal (or the timeout)."""

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    truncated: bool = False  # stdout + stderr were cut at the output cap

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class Sandbox(ABC):
    """Where one trajectory's commands run: a temporary directory (local) or a container.
    Paths the tools take are relative to `workdir` ("/work" in a container)."""

    workdir: str

    @abstractmethod
    def exec(
        self, argv: list[str], stdin: bytes | None = None, timeout: float | None = None
    ) -> ExecResult:
        """Run argv in workdir; the sandbox's exec timeout when `timeout` is None; output
        capped at the sandbox's max_output_bytes. Raises EnvironmentFailure only when the
        sandbox itself is gone."""

    @abstractmethod
    def close(self) -> None:
        """Remove the sandbox (idempotent)."""


class Episode(ABC):
    """One trajectory's environment instance, opened and reset for its scenario."""

    tools: list[ToolSpec]  # the catalog offered to the policy (MCP tools are added beside it)
    opening: str | None = None  # an observation from reset, appended as a user turn
    sandbox: Sandbox | None = None  # where its commands run, if anywhere (a verify's workspace)

    @abstractmethod
    def step(self, name: str, arguments: dict[str, Any]) -> Observation:
        """Run one call. An unknown tool or bad arguments are error observations; raises
        EnvironmentFailure when the environment itself fails."""

    def verify(self) -> Verification | None:
        """The final verdict, or None when the scenario declares no verify."""
        return None

    def summary(self) -> str | None:
        """The terminal state shown to a judge (metadata.env.summary), or None."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Release the instance (idempotent; called on success, failure and deadline)."""


class Environment(ABC):
    """A factory of episodes: [agent.environment] made live for a run."""

    @abstractmethod
    def open(self, scenario, seed: int) -> Episode:
        """A fresh episode for `scenario` (an agent.scenarios.Scenario), reset with `seed`.
        Raises EnvironmentFailure when set-up fails."""

    def grades(self, scenario) -> bool:
        """True when an episode of this scenario is scored by the environment (a verify
        command, or an HTTP environment, which may return rewards)."""
        return False

    def catalog(self, scenario=None) -> list[ToolSpec]:
        """The tools an episode of `scenario` offers (the default toolset for None), without
        opening one: for `tools list`, collect and scenario generation."""
        return []

    def check_scenarios(self, scenarios, require_verify: bool = False) -> None:  # noqa: B027
        """Refuse, before the first rollout, scenarios this environment cannot run (and, with
        require_verify, ones it cannot grade). Nothing to check by default."""

    def metrics(self) -> dict[str, float]:
        """env/* values since the last call (formats.md §7.2); none by default."""
        return {}

    def close(self) -> None:  # noqa: B027 (most environments hold nothing to release)
        """End of run: release pooled resources, reap what is left."""


@dataclass
class EpisodeLog:
    """What happened in one episode, for observe and collect."""

    calls: int = 0
    errors: int = 0
    step_rewards: list[float] = field(default_factory=list)
    seconds: float = 0.0
