"""Helpers for agentic tests: a tiny chat model, forced turns, and a small counter environment.

`Scripted` is a real Sampler whose choice of token is forced from a script (the turns a test
wants the model to write): prefill, the kept keys and values, stop handling and the rollout
logic all run as in training; only the draw is replaced. `CounterEnvironment` is a real
Environment of the agent interface (types.py) kept in memory: `add {n}` adds to a counter
(step reward 0.1 per call when `step_reward`), `finish {}` ends the episode, verify passes
when the counter equals the scenario's metadata.target.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from retrograd.agent.types import Environment, Episode, Observation, ToolSpec, Verification
from retrograd.errors import EnvironmentFailure
from retrograd.sampling import Sampler

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
EOS = 2  # the tiny vocabulary's </s>


def tiny_chat_model(directory: Path):
    import retrograd
    from tests.factories.tiny_gguf import write_tiny

    path = write_tiny(directory / "tiny-agent.gguf", "gemma3", chat_template=CHAT_TEMPLATE)
    return path, retrograd.load(path, device="cpu", dtype=torch.float32)


def call(name: str, **arguments) -> str:
    """A Hermes call without spaces (the tiny vocabulary writes spaces as ▁)."""
    import json

    body = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


class Scripted(Sampler):
    """A sampler that writes `scripts[seed][k]` as turn k of the trajectory seeded `seed`,
    ending it with EOS (or with no end token when the text is prefixed with "!cut:")."""

    def __init__(self, decoder, tokenizer, scripts):
        """scripts: {seed: [turn texts]}, or a function (seed, turn) -> text."""
        super().__init__(decoder, tokenizer, fast=False)
        self.scripts = scripts
        self.turn_of: dict[int, tuple] = {}  # generator id -> (generator, turns begun)
        self.current: dict[int, list[int]] = {}

    def forced(self, row) -> int:
        key = id(row.generator)
        if not row.ids:  # a new turn
            seed = row.generator.initial_seed()
            # the generator is kept referenced: a dead one's id could name a new trajectory
            k = self.turn_of.get(key, (None, 0))[1]
            self.turn_of[key] = (row.generator, k + 1)
            script = self.scripts
            text = script(seed, k) if callable(script) else script[seed][k]
            cut = text.startswith("!cut:")
            ids = self.tokenizer.tokenize(
                text.removeprefix("!cut:"), add_bos=False, parse_special=True
            )
            self.current[key] = ids if cut else [*ids, EOS]
        script = self.current[key]
        return script[len(row.ids)] if len(row.ids) < len(script) else script[-1]

    def choose(self, live, logits):
        tokens = [self.forced(r) for r in live]
        lp = torch.log_softmax(logits.float(), -1)
        return tokens, [float(lp[i, t]) for i, t in enumerate(tokens)]


ADD = ToolSpec(
    "add",
    "Add n to the counter.",
    {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
)
FINISH = ToolSpec("finish", "End the task.", {"type": "object", "properties": {}})


class CounterEpisode(Episode):
    def __init__(self, env: CounterEnvironment, scenario, seed: int):
        self.env, self.scenario, self.seed = env, scenario, seed
        self.tools = [ADD, FINISH]
        self.opening = env.opening
        self.total = 0
        self.closed = False

    def step(self, name, arguments):
        if self.env.broken_tool == name:
            raise EnvironmentFailure(f"scenario {self.scenario.id}: tool {name} broke")
        if name == "finish":
            return Observation("finished", done=True)
        n = arguments.get("n")
        if not isinstance(n, int):
            return Observation("argument 'n' must be an integer", is_error=True)
        self.total += n
        return Observation(f"total {self.total}", reward=self.env.step_reward)

    def verify(self):
        target = self.scenario.metadata.get("target")
        if target is None:
            return None
        ok = self.total == target
        return Verification(1.0 if ok else 0.0, ok, f"total {self.total}")

    def summary(self):
        return f"counter at {self.total}"

    def close(self):
        with self.env.lock:
            self.env.closed += 1
        self.closed = True


class CounterEnvironment(Environment):
    def __init__(self, step_reward=None, opening=None, fail_open_seeds=(), broken_tool=None):
        self.step_reward, self.opening = step_reward, opening
        self.fail_open_seeds, self.broken_tool = set(fail_open_seeds), broken_tool
        self.opened = self.closed = 0
        self.lock = threading.Lock()

    def open(self, scenario, seed):
        if seed in self.fail_open_seeds:
            raise EnvironmentFailure(f"scenario {scenario.id}: set-up failed")
        with self.lock:
            self.opened += 1
        return CounterEpisode(self, scenario, seed)

    def grades(self, scenario):
        return "target" in scenario.metadata

    def catalog(self, scenario=None):
        return [ADD, FINISH]
