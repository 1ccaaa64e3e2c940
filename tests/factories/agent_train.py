"""`retrograd train` with forced turns, for tests that run the real command in a process.

python -m tests.factories.agent_train train RUN.toml [--resume]: trajectories with even seeds
write "eeee", the others "abcd" (a command judge then tells them apart); everything else is
the real command. With RETRO_AGENT_SCRIPT=hostile the policy is `hostile`: tool calls no tool
can run, then an answer file in the even-seeded trajectories.
"""

from __future__ import annotations

import json
import os
import sys

import retrograd.sampling.backend as sampling_backend
from retrograd.cli.main import main
from tests.factories.agents import Scripted, call


def script(seed: int, turn: int) -> str:
    return "eeee" if seed % 2 == 0 else "abcd"


def hostile(seed: int, turn: int) -> str:
    """Turn 0: calls that parse and that the tools refuse (a NUL byte in a command, a path out
    of the workspace, an unknown tool, a list for a string, an unknown key); turn 1: calls that
    do not parse (a lone surrogate, nesting past the limit, NaN); turn 2: the even seeds write
    every scenario's answer (0 to 3, one a line: verify passes), the odd ones run a command;
    turn 3: no call, the end."""
    deep = json.loads("[" * 70 + "]" * 70)
    turns = [
        call("bash", command="a\x00b")
        + call("read_file", path="../../etc/passwd")
        + call("nope")
        + call("bash", command=["ls"])
        + call("write_file", path="f", content="x", mode=1),
        call("write_file", path="x", content="\ud800")
        + call("bash", command=deep)
        + '<tool_call>{"name":"bash","arguments":"{\\"command\\":NaN}"}</tool_call>',
        call("write_file", path="answer.txt", content="0\n1\n2\n3\n")
        if seed % 2 == 0
        else call("bash", command="echo${IFS}hi"),
        "done",
    ]
    return turns[min(turn, len(turns) - 1)]


SCRIPTS = {"default": script, "hostile": hostile}


def scripted_sampler(decoder, tokenizer, **settings):
    """The run's Sampler(decoder, tokenizer, fast=, max_len=, generation_batch=) (sampling/
    backend.py), scripted."""
    return Scripted(decoder, tokenizer, SCRIPTS[os.environ.get("RETRO_AGENT_SCRIPT", "default")])


if __name__ == "__main__":
    sampling_backend.Sampler = scripted_sampler
    sys.exit(main(sys.argv[1:]))
