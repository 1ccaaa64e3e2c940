"""A counter game behind the Environment interface, for collect tests: `add {n}` adds to a
counter (a non-integer n is an error observation, a step reward of 0.1 per add), `done` ends
the episode, `explode` fails the environment; verify passes when the counter reaches the
scenario's metadata.target. A test double of the interface, not of any environment we ship.
"""

from __future__ import annotations

from typing import Any

from retrograd.agent.scenarios import Scenario, parse_scenario
from retrograd.agent.types import Environment, Episode, Observation, ToolSpec, Verification
from retrograd.errors import EnvironmentFailure

TOOLS = [
    ToolSpec(
        "add",
        "Add n to the counter.",
        {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
    ),
    ToolSpec("done", "Finish.", {"type": "object", "properties": {}}),
    ToolSpec("explode", "Break the environment.", {"type": "object", "properties": {}}),
]


def scenario(sid: str = "count-3", target: int = 3, index: int = 0, **extra) -> Scenario:
    record = {"id": sid, "user": f"Bring the counter to {target}.", "metadata": {"target": target}}
    record.update(extra)
    return parse_scenario(record, f"scenarios.jsonl:{index + 1}", index)


class CounterEpisode(Episode):
    def __init__(self, env: CounterEnv, scenario: Scenario, seed: int):
        self.env, self.scenario, self.seed = env, scenario, seed
        self.tools = list(TOOLS)
        self.opening = env.opening
        self.counter = 0
        self.closed = False

    def step(self, name: str, arguments: dict[str, Any]) -> Observation:
        self.env.steps.append((self.scenario.id, self.seed, name, arguments))
        if name == "explode":
            raise EnvironmentFailure(f"{self.scenario.id}: the counter exploded")
        if name == "done":
            return Observation("finished", done=True)
        n = arguments.get("n")
        if not isinstance(n, int):
            return Observation("argument 'n' must be an integer", is_error=True)
        self.counter += n
        return Observation(f"counter = {self.counter}", reward=0.1)

    def verify(self) -> Verification | None:
        target = self.scenario.metadata.get("target")
        if target is None:
            return None
        passed = self.counter == target
        return Verification(1.0 if passed else 0.0, passed, f"counter {self.counter}")

    def summary(self) -> str | None:
        return f"counter {self.counter}"

    def close(self) -> None:
        self.closed = True
        self.env.closed += 1


class CounterEnv(Environment):
    def __init__(self, opening: str | None = None, fail_open: bool = False):
        self.opening, self.fail_open = opening, fail_open
        self.steps: list[tuple] = []
        self.opened: list[tuple[str, int]] = []
        self.closed = 0

    def open(self, scenario, seed: int) -> CounterEpisode:
        if self.fail_open:
            raise EnvironmentFailure(f"{scenario.id}: set-up failed")
        self.opened.append((scenario.id, seed))
        return CounterEpisode(self, scenario, seed)

    def grades(self, scenario) -> bool:
        return "target" in scenario.metadata

    def catalog(self, scenario=None) -> list[ToolSpec]:
        return list(TOOLS)
