"""The algorithms this version trains: one row each, naming its loop and its traits.

The one list of algorithms. The commands (cli/train.py, cli/profile.py, cli/main.py's help),
the run server (server/child.py) and the tests read it; the distributed layer receives a row's
`Traits`, never a name to look up. A loop is imported only when its row is run: each pulls in
torch and its own parts, and this module imports nothing heavy.

Config keeps its own facts about the run file ([run].algorithm's values, the section each
reads, which may be observed): config sits below algorithms and cannot read this table;
tests/unit/algorithms/test_table.py holds the two together.

Adding an algorithm: a loop file, a row here, its config section (config/document.py) and a
docs page.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from retrograd.errors import ConfigError


@dataclass(frozen=True)
class Traits:
    """How a loop's ranks share its work (docs/distributed.md)."""

    data_parallel: bool  # torchrun ranks share its work (ddp)
    lockstep: bool  # every rank runs the same forward and backward passes, in order
    samples: bool  # it generates with the policy: whole weights on every rank, a sampler

    @property
    def sharded(self) -> bool:
        """Whether it admits [training].parallel = "fsdp2" (its blocks sharded over the ranks:
        every gather is a collective, so every rank must run every pass)."""
        return self.lockstep and not self.samples


@dataclass(frozen=True)
class Algorithm:
    name: str  # [run].algorithm, or distill/<mode>
    section: str  # the run file's section it reads
    entry: str  # "module:function", imported when the row is run
    traits: Traits

    @property
    def algorithm(self) -> str:
        """[run].algorithm: the name without its mode."""
        return self.name.split("/")[0]

    def loop(self) -> Callable:
        module, function = self.entry.split(":")
        return getattr(importlib.import_module(module), function)


_TEXT = Traits(data_parallel=True, lockstep=True, samples=False)
_ROLLOUT = Traits(data_parallel=True, lockstep=False, samples=True)
_LOOPS = "retrograd.algorithms"

ALGORITHMS: tuple[Algorithm, ...] = (
    Algorithm("sft", "sft", f"{_LOOPS}.sft:run_sft", _TEXT),
    Algorithm("ppo", "ppo", f"{_LOOPS}.ppo:run_ppo", _ROLLOUT),
    Algorithm("grpo", "grpo", f"{_LOOPS}.grpo:run_grpo", _ROLLOUT),
    Algorithm("preference", "preference", f"{_LOOPS}.preference:run_preference", _TEXT),
    Algorithm(
        "distill/topk_offline",
        "distill",
        f"{_LOOPS}.distill_offline:run_distill_offline",
        _TEXT,
    ),
    Algorithm("distill/on_policy", "distill", f"{_LOOPS}.distill:run_on_policy", _ROLLOUT),
    Algorithm("agent_grpo", "agent", f"{_LOOPS}.agent_grpo:run_agent_grpo", _ROLLOUT),
)


def names() -> list[str]:
    """The [run].algorithm values, in the table's order (distill once)."""
    return list(dict.fromkeys(a.algorithm for a in ALGORITHMS))


def algorithm_of(cfg) -> Algorithm:
    """The row a run file chooses: [run].algorithm, distill's by [distill].mode."""
    name = cfg.run.algorithm
    if name == "distill":
        name = f"distill/{cfg.distill.mode}"
    for row in ALGORITHMS:
        if row.name == name:
            return row
    raise ConfigError(f"[run].algorithm = {name!r}: this version trains {', '.join(names())}")


def check_world(row: Algorithm) -> None:
    """Refuse a row the process's world cannot run (several ranks, fsdp2), before it loads."""
    from retrograd import distributed

    sharded = ", ".join(a.name for a in ALGORITHMS if a.traits.sharded)
    where = f"[run].algorithm = {row.name!r}"
    distributed.check_traits(row.traits, distributed.world(), where, sharded)


def run(cfg, door=None, *, resume=None, sinks=None, run_file=None):
    """Run the loop the run file chooses, in the process's world (distributed.init_world
    first under torchrun), through `door` (algorithms/frame.py; or one made of resume, sinks
    and run_file) -> its result."""
    from retrograd.algorithms.frame import door_of

    row = algorithm_of(cfg)
    check_world(row)
    return row.loop()(cfg, door_of(door, resume=resume, sinks=sinks, run_file=run_file))
