"""Scale-out on torchrun: the world of ranks, each rank's share of a step, and the sum of the
ranks' gradients that makes the step equal one process doing all of it (docs/distributed.md).

The API every loop uses:
  World(rank, size, local_rank, backend, parallel)  .main (rank 0)  .active (size > 1)
  init_world(cfg) -> World      torchrun's RANK / WORLD_SIZE / LOCAL_RANK -> init_process_group
                                (gloo on a CPU, nccl on CUDA, [training].dist_timeout_seconds);
                                outside torchrun (or one rank) World(0, 1, 0, None)
  world() -> World              the current one;  close_world() at the end of the command
  last_barrier()                the command's last collective, once rank 0 has written the
                                output: the ranks leave together, and no gloo worker thread
                                touches a Python object after it (the interpreter's teardown)
  share(n, world) -> list[int]  this rank's items of n: contiguous blocks in rank order, so the
                                shares together and in order are one process's n items
  check_traits(traits, world, where)  a loop's traits (algorithms/table.py) against the world:
                                several ranks need data_parallel, fsdp2 needs sharded
  wrap_trainable(model, trainables, world) -> Replicas
                                the trained tensors made equal on every rank, a Replicas whose
                                sum_step adds the ranks' gradients; fsdp2 first shards the
                                decoder's blocks (distributed/fsdp2.py), Replicas.sharded says so
  Replicas.sum_step(params, *values) -> values summed over the ranks, gradients summed in place
  all_reduce_sum(values), gather_objects(obj), broadcast_object(obj), barrier()
  (the ranks' checkpoints are the checkpoint layer's: checkpoint/ranks.py)

What this package does not know: losses, data, the algorithms' names. The loops decide what a
share is (the passes of an SFT step, the pieces of a preference step) and scale each share's
loss by the step's global count, so that summing (not averaging) the ranks' gradients gives the
step of one process. Rank 0 alone prints, writes metrics, checkpoints' metadata and the output.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from retrograd import environ
from retrograd.errors import ConfigError

log = logging.getLogger(__name__)
PARALLEL = ("none", "ddp", "fsdp2")
BUCKET_BYTES = 32 << 20  # gradients all-reduced per flat buffer of at most this many bytes


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str | None = None  # gloo, nccl; None without a process group
    parallel: str = "none"  # what [training].parallel resolved to

    @property
    def main(self) -> bool:
        """Rank 0: the one that prints, writes metrics, checkpoint metadata and the output."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.size > 1


_WORLD = World()


def world() -> World:
    return _WORLD


def launched() -> tuple[int, int, int] | None:
    """(rank, size, local_rank) when torchrun (or torch.distributed.elastic) started us."""
    rank, size = environ.get("RANK"), environ.get("WORLD_SIZE")
    if rank is None or size is None:
        return None
    return rank, size, environ.get("LOCAL_RANK") or 0


def resolve_parallel(setting: str | None, size: int) -> str:
    """[training].parallel for a world of `size` ranks. Unset: ddp with several ranks, none
    alone. Set to ddp or fsdp2 with one rank: one process (a note says so). none with several
    ranks is refused: each rank would train the whole run on its own."""
    if setting is None:
        return "ddp" if size > 1 else "none"
    if setting not in PARALLEL:
        raise ConfigError(f"[training].parallel = {setting!r}: must be none, ddp or fsdp2")
    if size > 1 and setting == "none":
        raise ConfigError(
            f'[training].parallel = "none" under torchrun with {size} ranks: each rank would '
            'train the whole run alone; use "ddp" or "fsdp2", or launch one process'
        )
    if size == 1 and setting != "none":
        log.info("[training].parallel = %r with one process: it trains alone", setting)
    return setting


def init_world(cfg) -> World:
    """The run's world from torchrun's environment; the process group is opened here."""
    global _WORLD
    found = launched()
    setting = getattr(cfg.training, "parallel", None)
    if found is None or found[1] == 1:
        _WORLD = World(parallel=resolve_parallel(setting, 1))
        return _WORLD
    rank, size, local_rank = found
    parallel = resolve_parallel(setting, size)
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and cfg.model.device != "cpu"
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=cfg.training.dist_timeout_seconds)
        dist.init_process_group(backend, timeout=timeout)
    _WORLD = World(rank, size, local_rank, backend, parallel)
    log.info("rank %d of %d (%s, %s)", rank, size, backend, parallel)
    return _WORLD


def close_world() -> None:
    """Leave the process group (the command's end, error or not)."""
    global _WORLD
    if _WORLD.active:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    _WORLD = World()


def share(n: int, w: World | None = None) -> list[int]:
    """This rank's indices of n items: rank r takes the r-th of `size` contiguous blocks (the
    first n % size blocks one longer), so the ranks' shares in rank order are 0..n-1."""
    w = w or _WORLD
    base, extra = divmod(n, w.size)
    start = w.rank * base + min(w.rank, extra)
    return list(range(start, start + base + (w.rank < extra)))


# -- collectives -----------------------------------------------------------------------------


def barrier() -> None:
    if _WORLD.active:
        import torch.distributed as dist

        dist.barrier()


def last_barrier() -> None:
    """The command's last collective (every rank, once rank 0 has written the output): the
    ranks leave together, and afterwards no gloo worker thread touches a Python object.

    NOTE: why its Work is kept to the end of the process. A gloo Work is deleted by whoever
    drops its last reference, often the gloo worker thread that ran it (after waking the
    waiter), and a barrier's Work holds weak references to every Work still running or queued
    when it was issued, whose tensors live until the barrier's Work is deleted. Deleting a
    tensor that Python has seen releases its Python object, which takes the GIL; a thread
    that asks for the GIL while the interpreter finalizes is ended with pthread_exit, whose
    unwinding through a noexcept destructor aborts the process ("terminate called without an
    active exception", SIGABRT) after a run that had finished (seen on the rank that waits
    while rank 0 writes, under fsdp2, whose device mesh keeps the group and its threads alive
    past close_world). A Work a worker thread has finished with is deleted before the barrier
    is issued (both under gloo's work lock), or else the barrier holds it; kept here, the
    barrier's Work and every Work it holds are never deleted by a worker thread, which only
    drops its own reference to the barrier's."""
    if not _WORLD.active:
        return
    import torch.distributed as dist

    work = dist.barrier(async_op=True)
    work.wait()
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(work))  # never released, teardown included


def broadcast_object(obj, src: int = 0):
    """`obj` of rank `src` on every rank (picklable)."""
    if not _WORLD.active:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if not _WORLD.active:
        return [obj]
    import torch.distributed as dist

    out: list = [None] * _WORLD.size
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(values: Sequence[float]) -> list[float]:
    """The sums over the ranks of a few float64 numbers."""
    if not _WORLD.active:
        return list(values)
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64, device=_device())
    dist.all_reduce(t)
    return t.cpu().tolist()


def _device() -> torch.device:
    return torch.device("cuda") if _WORLD.backend == "nccl" else torch.device("cpu")


# -- the trained tensors -----------------------------------------------------------------------


class Replicas:
    """Every rank holds all trained tensors (ddp). sum_step adds the ranks' gradients into each
    one, in flat buckets, with the step's scalars (loss sums) riding along in the first.

    NOTE: torch's DistributedDataParallel is not used: its reducer needs every rank to run the
    same number of forward/backward calls through one module, and our steps run a share of
    cached passes per rank (an SFT window's passes, a preference step's pieces), some ranks
    none, with the output head outside the decoder's forward. A bucketed all_reduce of the
    gradients after the rank's share is the same arithmetic (docs/distributed.md)."""

    def __init__(self, w: World, sharded: bool = False):
        self.world = w
        self.sharded = sharded  # the decoder's blocks sharded over the ranks (fsdp2)

    def sum_step(self, params: Sequence[torch.Tensor], *values: float) -> tuple[float, ...]:
        """After this rank's backward passes of a step: each parameter's gradient becomes the
        sum over the ranks (None where no rank has one); returns `values` summed too."""
        if not self.world.active:
            return tuple(values)
        import torch.distributed as dist

        device = params[0].device if params else _device()
        flags = [p.grad is not None for p in params]
        head = torch.tensor([*values, *map(float, flags)], dtype=torch.float64, device=device)
        dist.all_reduce(head)
        has = [bool(f) for f in head[len(values) :].tolist()]
        for bucket in _buckets([p for p, h in zip(params, has, strict=True) if h]):
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            at = 0
            for p in bucket:
                n = p.numel()
                p.grad = flat[at : at + n].view_as(p).clone()
                at += n
        return tuple(head[: len(values)].tolist())

    def make_equal(self, params: Sequence[torch.Tensor]) -> None:
        """Rank 0's values in every rank's trained tensors (they start equal by seed; this
        makes it so whatever a rank's initialisation did)."""
        if not self.world.active:
            return
        import torch.distributed as dist

        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, src=0)


def _buckets(params: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive parameters of one dtype, at most BUCKET_BYTES a bucket (one alone if larger)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not out or out[-1][0].dtype != p.dtype or size + nbytes > BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return out


def wrap_trainable(model, trainables, w: World | None = None) -> Replicas:
    """The world's handle on the trained tensors, equal on every rank; under fsdp2 with
    several ranks the decoder's blocks are sharded first (fsdp2.py)."""
    w = w or _WORLD
    found = launched()
    if found is not None and found[1] > 1 and not w.active:
        raise ConfigError(
            f"torchrun started {found[1]} ranks but this process has not joined them: call "
            "retrograd.distributed.init_world(cfg) before the loop (docs/distributed.md)"
        )
    sharded = w.parallel == "fsdp2" and w.active
    if sharded:
        try:
            from retrograd.distributed import fsdp2
        except ImportError:
            raise ConfigError(
                '[training].parallel = "fsdp2": this PyTorch has no FSDP2 '
                '(torch.distributed.fsdp.fully_shard); use "ddp" or a newer torch'
            ) from None
        fsdp2.shard_decoder(model.decoder, trainables.params)
    replicas = Replicas(w, sharded)
    replicas.make_equal(trainables.params)
    return replicas


def check_traits(
    traits, w: World | None = None, where: str = "this loop", sharded: str = ""
) -> None:
    """Refuse a loop the world cannot run, before anything loads. traits: an algorithm's
    (algorithms/table.py: data_parallel, sharded); where: how messages name it
    ("[run].algorithm = 'grpo'"); sharded: the loops fsdp2 takes, for the message."""
    w = w or _WORLD
    if not w.active:
        return
    if not traits.data_parallel:
        raise ConfigError(
            f"{where} does not run on several ranks in this version (torchrun started "
            f"{w.size}); launch one process"
        )
    if w.parallel == "fsdp2" and not traits.sharded:  # sharded blocks: every rank every pass
        raise ConfigError(
            f'[training].parallel = "fsdp2": {where} does not run its ranks in step (each rank '
            'scores or samples its own share) in this version; use "ddp"'
            + (f", or train {sharded} with fsdp2" if sharded else "")
        )
