"""An update's rollouts spread over the ranks of a data-parallel run (torchrun), so that the
update equals one process doing all of it.

- Every rank draws the same prompts (the prompt stream is a pure function of the seeds and
  the cursor) and takes a contiguous block of them (`block`): rank r of N samples groups
  [lo, hi). A group's answers keep their seeds derive_seed(seed, "sample", update, cursor,
  member), so they do not depend on the rank or on N.
- The rank that sampled a group computes its rewards (the reward program, the judge, the
  penalties) once; `spread` then hands every rank the whole update's groups in order, so the
  advantages, the metrics, the skip decisions and the loop's branches are those of one
  process, on every rank alike.
- Each rank scores and back-propagates its own block's answers with the loss normalised by
  the whole update's counts (`total`); `sum_gradients` adds the ranks' gradients, which is
  the gradient one process accumulates over all the answers. The clipping and the optimizer
  step then run on identical gradients on every rank: the replicas stay equal.
- One process (no torchrun) takes every path here unchanged: a block of everything, nothing
  gathered.

The collectives are retrograd.distributed's (gather_objects, all_reduce_sum, and the
Replicas' sum_step for the gradients); every rank calls them in the same order, as the loops
take the same branches. Sharded weights (parallel = "fsdp2") never come here: the algorithm
table marks the rollout loops as sampling (the in-process sampler reads whole weights), and
they are refused before they load.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from retrograd import distributed

T = TypeVar("T")
R = TypeVar("R")


def current_world() -> distributed.World:
    """The process's world: one process outside torchrun."""
    return distributed.world()


def block(n: int, world: distributed.World) -> tuple[int, int]:
    """This rank's contiguous share [lo, hi) of n items (distributed.share): the ranks'
    blocks in rank order are 0..n."""
    mine = distributed.share(n, world)
    return (mine[0], mine[-1] + 1) if mine else (0, 0)


def everyone(local: list[T], world: distributed.World) -> list[T]:
    """The ranks' lists concatenated in rank order, on every rank."""
    if not world.active:
        return list(local)
    return [x for part in distributed.gather_objects(list(local)) for x in part]


def spread(
    items: Sequence[T], fn: Callable[[list[T], int], list[R]], world: distributed.World
) -> list[R]:
    """fn over this rank's block of `items` (fn(block, lo) -> one result per item), the
    results of every rank gathered in the items' order, on every rank."""
    lo, hi = block(len(items), world)
    mine = fn(list(items[lo:hi]), lo)
    assert len(mine) == hi - lo, (len(mine), lo, hi)
    return everyone(mine, world)


def total(values: dict[str, float], world: distributed.World) -> dict[str, float]:
    """Each value's sum over the ranks."""
    if not world.active:
        return dict(values)
    return dict(zip(values, distributed.all_reduce_sum(list(values.values())), strict=True))


def sum_gradients(params: Sequence, world: distributed.World) -> None:
    """Every trained Parameter's gradient replaced by its sum over the ranks (a rank whose
    block trained nothing adds zeros): the gradient one process accumulates."""
    if world.active:
        distributed.Replicas(world).sum_step(list(params))
