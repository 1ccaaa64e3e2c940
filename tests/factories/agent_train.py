"""`retrograd train` with forced turns, for tests that kill a real process mid-run.

python -m tests.factories.agent_train train RUN.toml [--resume]: trajectories with even seeds
write "eeee", the others "abcd" (a command judge then tells them apart); everything else is
the real command.
"""

from __future__ import annotations

import sys

import retrograd.algorithms.agent_grpo as agent_grpo
from retrograd.cli.main import main
from tests.factories.agents import Scripted


def script(seed: int, turn: int) -> str:
    return "eeee" if seed % 2 == 0 else "abcd"


def scripted_sampler(decoder, tokenizer, **settings):
    """agent_grpo's Sampler(decoder, tokenizer, fast=, max_len=, generation_batch=), scripted."""
    return Scripted(decoder, tokenizer, script)


if __name__ == "__main__":
    agent_grpo.Sampler = scripted_sampler
    sys.exit(main(sys.argv[1:]))
