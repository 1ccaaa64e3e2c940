"""rollout/spread.py without a process group: the blocks of an update's groups tile it in rank
order, and one process takes every path unchanged (the 2-rank runs are in
tests/e2e/test_distributed_rl.py)."""

from __future__ import annotations

import pytest
import torch

from retrograd.distributed import World
from retrograd.rollout import spread


@pytest.mark.parametrize("n", [0, 1, 3, 8])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_blocks_tile_the_groups_in_rank_order(n, size):
    blocks = [spread.block(n, World(rank=r, size=size)) for r in range(size)]
    covered = [i for lo, hi in blocks for i in range(lo, hi)]
    assert covered == list(range(n))
    assert max(hi - lo for lo, hi in blocks) - min(hi - lo for lo, hi in blocks) <= 1


def test_one_process_maps_everything_and_gathers_nothing():
    alone = World()
    seen = []

    def fn(part, lo):
        seen.append((list(part), lo))
        return [x * 10 for x in part]

    assert spread.spread([1, 2, 3], fn, alone) == [10, 20, 30]
    assert seen == [([1, 2, 3], 0)]
    assert spread.total({"loss": 1.5, "gap": 0.25}, alone) == {"loss": 1.5, "gap": 0.25}
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    spread.sum_gradients([p], alone)
    assert torch.equal(p.grad, torch.full((3,), 2.0))
