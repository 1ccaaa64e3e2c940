"""The algorithm table agrees with the run file's facts (config sits below and keeps its own),
and each row runs its loop."""

from __future__ import annotations

import inspect
import typing
from types import SimpleNamespace

import pytest

from retrograd.algorithms import table
from retrograd.config.algorithms import DistillOffline, DistillOnPolicy
from retrograd.config.core import Algorithm
from retrograd.config.document import ALGORITHM_SECTIONS, OBSERVE_ALGORITHMS
from retrograd.errors import ConfigError


def test_the_table_names_every_algorithm_of_the_run_file_with_its_section():
    assert set(table.names()) == set(typing.get_args(Algorithm))
    assert {(a.algorithm, a.section) for a in table.ALGORITHMS} == set(ALGORITHM_SECTIONS.items())
    modes = {a.name for a in table.ALGORITHMS if a.algorithm == "distill"}
    written = {
        typing.get_args(s.model_fields["mode"].annotation)[0]
        for s in (DistillOnPolicy, DistillOffline)
    }
    assert modes == {f"distill/{m}" for m in written}


def test_what_config_observes_samples():
    sampling = {a.algorithm for a in table.ALGORITHMS if a.traits.samples}
    assert set(OBSERVE_ALGORITHMS) <= sampling


def test_only_lockstep_loops_that_do_not_sample_shard():
    sharded = sorted(a.name for a in table.ALGORITHMS if a.traits.sharded)
    assert sharded == ["distill/topk_offline", "preference", "sft"]
    assert all(a.traits.data_parallel for a in table.ALGORITHMS)


@pytest.mark.parametrize("row", table.ALGORITHMS, ids=lambda a: a.name)
def test_each_row_names_a_loop_the_commands_can_call(row):
    loop = row.loop()
    assert callable(loop) and loop.__module__ == row.entry.split(":")[0]
    assert {"resume", "sinks", "run_file"} <= set(inspect.signature(loop).parameters)


def _cfg(algorithm: str, mode: str | None = None) -> SimpleNamespace:
    """What algorithm_of reads of a run config."""
    return SimpleNamespace(
        run=SimpleNamespace(algorithm=algorithm), distill=SimpleNamespace(mode=mode)
    )


def test_a_run_file_chooses_its_row_distill_by_its_mode():
    assert table.algorithm_of(_cfg("sft")).name == "sft"
    assert table.algorithm_of(_cfg("agent_grpo")).section == "agent"
    assert table.algorithm_of(_cfg("distill", "topk_offline")).name == "distill/topk_offline"
    assert table.algorithm_of(_cfg("distill", "on_policy")).name == "distill/on_policy"


def test_a_name_the_table_lacks_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"\[run\].algorithm = 'dpo': this version trains sft"):
        table.algorithm_of(_cfg("dpo"))
    with pytest.raises(ConfigError, match=r"'distill/later'"):
        table.algorithm_of(_cfg("distill", "later"))


def test_the_world_is_checked_before_a_loop_loads(monkeypatch):
    """Several ranks sharding the blocks (fsdp2): a loop that samples is refused by table.run,
    whatever door calls it, naming the loops fsdp2 takes; a lockstep one passes."""
    from retrograd import distributed

    fsdp2 = distributed.World(rank=0, size=2, parallel="fsdp2")
    monkeypatch.setattr(distributed, "_WORLD", fsdp2)
    for name in ("grpo", "ppo", "agent_grpo"):
        with pytest.raises(ConfigError, match=rf"{name}' does not run its ranks in step"):
            table.run(_cfg(name))
    with pytest.raises(ConfigError, match=r"or train sft, preference, distill/topk_offline with"):
        table.run(_cfg("distill", "on_policy"))
    table.check_world(table.algorithm_of(_cfg("sft")))
    monkeypatch.setattr(distributed, "_WORLD", distributed.World(rank=0, size=2, parallel="ddp"))
    table.check_world(table.algorithm_of(_cfg("grpo")))
