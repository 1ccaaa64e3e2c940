"""The world: shares of a step, [training].parallel as it resolves, and the gradient sum of two
gloo ranks (spawned processes, a hard timeout) against the arithmetic done by hand."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from retrograd import distributed
from retrograd.algorithms import table
from retrograd.config.load import validate_run
from retrograd.distributed import Replicas, World, resolve_parallel, share
from retrograd.errors import ConfigError
from tests.unit.config.config_runs import run_doc


@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize("n", [0, 1, 2, 7, 8])
def test_shares_in_rank_order_are_the_whole_window(n, size):
    shares = [share(n, World(rank=r, size=size)) for r in range(size)]
    assert [i for s in shares for i in s] == list(range(n))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_parallel_resolves_by_world_size():
    assert resolve_parallel(None, 1) == "none"
    assert resolve_parallel(None, 2) == "ddp"
    assert resolve_parallel("ddp", 1) == "ddp"  # one process: trains alone
    assert resolve_parallel("fsdp2", 4) == "fsdp2"
    with pytest.raises(ConfigError, match=r'parallel = "none" under torchrun with 2 ranks'):
        resolve_parallel("none", 2)


def test_config_keys_validate():
    cfg = validate_run(run_doc(training={"parallel": "ddp", "dist_timeout_seconds": 60}))
    assert (cfg.training.parallel, cfg.training.dist_timeout_seconds) == ("ddp", 60)
    assert validate_run(run_doc()).training.parallel is None
    with pytest.raises(ConfigError, match="parallel"):
        validate_run(run_doc(training={"parallel": "tp"}))
    with pytest.raises(ConfigError, match="dist_timeout_seconds"):
        validate_run(run_doc(training={"dist_timeout_seconds": 0}))


def test_outside_torchrun_the_world_is_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    cfg = validate_run(run_doc(training={"parallel": "ddp"}))
    w = distributed.init_world(cfg)
    assert (w.rank, w.size, w.main, w.active, w.parallel) == (0, 1, True, False, "ddp")
    distributed.close_world()


def test_every_loop_shares_its_work_on_several_ranks():
    for row in table.ALGORITHMS:
        distributed.check_traits(row.traits, World(rank=0, size=2))
        distributed.check_traits(row.traits, World())


def test_a_loop_that_cannot_share_its_work_is_refused_on_several_ranks():
    alone = table.Traits(data_parallel=False, lockstep=True, samples=False)
    with pytest.raises(ConfigError, match=r"^\[run\].algorithm = 'x' does not run on several"):
        distributed.check_traits(alone, World(rank=0, size=2), "[run].algorithm = 'x'")
    distributed.check_traits(alone, World())


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    distributed._WORLD = World(rank, 2, rank, "gloo", "ddp")
    a = torch.nn.Parameter(torch.full((3,), float(rank + 1)))  # rank 0: 1s, rank 1: 2s
    b = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))  # no gradient anywhere
    c = torch.nn.Parameter(torch.zeros(4))  # a gradient on rank 1 only
    replicas = Replicas(distributed.world())
    replicas.make_equal([a])  # rank 0's values everywhere
    (a * torch.arange(3.0) * (rank + 1)).sum().backward()
    if rank == 1:
        c.sum().backward()
    (loss,) = replicas.sum_step([a, b, c], 0.5 + rank)
    out.put((rank, a.detach().tolist(), a.grad.tolist(), b.grad, c.grad.tolist(), loss))
    dist.destroy_process_group()


def test_sum_step_adds_two_ranks_gradients():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_ranks, args=(r, _port_once(), out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for rank, a, grad_a, grad_b, grad_c, loss in results:
        assert a == [1.0, 1.0, 1.0], rank
        assert grad_a == [0.0, 3.0, 6.0]  # arange * 1 + arange * 2
        assert grad_b is None
        assert grad_c == [1.0] * 4
        assert loss == 2.0


_PORT: list[int] = []


def _port_once() -> int:
    if not _PORT:
        _PORT.append(_port())
    return _PORT[0]


def test_a_checkpoint_resumes_only_with_the_world_size_that_saved_it():
    import dataclasses

    from retrograd.checkpoint.ranks import WORLD_SIZE, check_world
    from tests.unit.checkpoint.sample_state import make_state

    state = make_state()
    ident = state.identity
    two = dataclasses.replace(
        state,
        identity=dataclasses.replace(
            ident, trajectory_settings={**ident.trajectory_settings, WORLD_SIZE: 2}
        ),
    )
    check_world(state, "ck/one.state")  # one process saved it, one resumes
    with pytest.raises(ConfigError, match=r"saved by 2 ranks and this run has 1 \(the world"):
        check_world(two, "ck/two.state")


def test_buckets_hold_one_dtype_within_the_byte_limit(monkeypatch):
    from retrograd.distributed import _buckets

    monkeypatch.setattr(distributed, "BUCKET_BYTES", 64)
    ps = [torch.zeros(8), torch.zeros(8), torch.zeros(4, dtype=torch.float64), torch.zeros(40)]
    sizes = [[p.numel() for p in b] for b in _buckets(ps)]
    assert sizes == [[8, 8], [4], [40]]  # 32 + 32 bytes; a new dtype; one alone past the limit


def test_a_loop_under_torchrun_without_the_world_is_refused(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="torchrun started 2 ranks but this process has not"):
        distributed.wrap_trainable(None, None, World())


def _held_after(end, rank: int) -> int:
    """A broadcast still running on rank 1 when `end` (the barrier) is issued: rank 0 sends a
    second later and rank 1 has let go of its Work, as broadcast_object does of its own once
    waited. The references to the broadcast's tensor beyond Python's own, half a second after
    `end` returned (time for the gloo worker threads to finish with their Works)."""
    import sys
    import time

    import torch.distributed as dist

    t = torch.zeros(4)
    alone = sys.getrefcount(t)
    if rank == 0:
        time.sleep(1.0)
    dist.broadcast(t, src=0, async_op=True)  # its Work dropped at once
    end()
    time.sleep(0.5)
    return sys.getrefcount(t) - alone


def _last_barrier_ranks(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    distributed._WORLD = World(rank, 2, rank, "gloo", "ddp")
    plain = _held_after(distributed.barrier, rank)
    last = _held_after(distributed.last_barrier, rank)
    out.put((rank, plain, last))
    distributed.close_world()


def test_the_last_barrier_keeps_what_a_gloo_worker_thread_would_release():
    """The premise: after a plain barrier, the broadcast that was running when it was issued is
    released by whoever deletes the barrier's Work, often a gloo worker thread, which takes the
    GIL to release the tensor's Python object (an abort if the interpreter is finalizing).
    After last_barrier nothing of it is released: the tensor keeps the Work's reference."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_last_barrier_ranks, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {r: (plain, last) for r, plain, last in (out.get(timeout=60) for _ in procs)}
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert results[1] == (0, 1)  # rank 1's broadcast ran past the barrier's start
    assert results[0][0] == 0
