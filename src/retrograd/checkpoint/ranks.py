"""Checkpoints of a run on several ranks, written by all of them together (the ranks are
retrograd.distributed's; this module sits above it).

A distributed checkpoint is the `.state` directory one process writes (rank 0: metadata,
position, the adapter factors and the sibling .gguf export, the optimizer's groups) with two
additions inside it, both covered by its manifest and landed by the same atomic rename:
- `dcp/`: the trained tensors and the optimizer's slots, saved by every rank at once with
  torch.distributed.checkpoint (each rank its own shards under fsdp2; replicated tensors once);
- `artifacts/rng-rank<r>.msgpack`: each rank's random generators.
Resume reads the tensors and slots back from dcp/ into each rank's own (sharded or not), and
each rank its generators. A checkpoint resumes with the world size that saved it; any other is
refused naming both (docs/distributed.md). torch reads dcp/.metadata with pickle:
check_metadata unpickles it first with only its metadata classes allowed, so a checkpoint from
someone else runs no code. This module knows no loop; run.py calls it.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import pathlib
import pickle
import sys
from pathlib import Path

import msgpack
import torch

from retrograd.checkpoint import CheckpointState, RngState, save_checkpoint
from retrograd.checkpoint.layout import CheckpointError
from retrograd.distributed import barrier, broadcast_object, gather_objects, world
from retrograd.errors import ConfigError

DCP_DIR = "dcp"
WORLD_SIZE = "world_size"  # in the trajectory settings of a checkpoint saved by several ranks


def rng_artifact(rank: int) -> str:
    return f"rng-rank{rank}.msgpack"


def tensors_of(named, optimizer) -> dict[str, torch.Tensor]:
    """{trained/<name>: tensor, optimizer/<name>/<slot>: tensor}: what dcp/ holds."""
    out = {f"trained/{n}": p for n, p in named}
    for n, p in named:
        for slot, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"optimizer/{n}/{slot}"] = value
    return out


def save_state(directory, checkpoint_id: str, state: CheckpointState, named, optimizer) -> Path:
    """Every rank calls this at the same step: rank 0 writes `state` (with each rank's
    generators) as `<directory>/<checkpoint_id>.state`, every rank its part of dcp/ inside it
    before it lands. Returns the landed path on every rank."""
    import torch.distributed.checkpoint as dcp

    w = world()
    generators = gather_objects(dict(state.rng.generators))
    tensors = tensors_of(named, optimizer)

    def fill(tmp: Path) -> None:
        broadcast_object(str(tmp))
        dcp.save(tensors, checkpoint_id=str(tmp / DCP_DIR))
        barrier()

    if w.main:
        arts = {rng_artifact(r): msgpack.packb(g) for r, g in enumerate(generators)}
        state = dataclasses.replace(state, artifacts={**state.artifacts, **arts})
        final = save_checkpoint(directory, checkpoint_id, state, fill=fill)
    else:
        tmp = Path(broadcast_object(None))
        dcp.save(tensors, checkpoint_id=str(tmp / DCP_DIR))
        barrier()
        final = None
    return Path(broadcast_object(str(final) if final is not None else None))


METADATA = ".metadata"  # torch.distributed.checkpoint's index of dcp/, a pickle


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles only what torch.distributed.checkpoint writes in its .metadata: its metadata
    dataclasses, _StorageInfo, torch.Size, dtypes, layouts and paths. A pickle runs whatever
    callable it names; a checkpoint from someone else must not run anything."""

    def find_class(self, module: str, name: str):
        import torch.distributed.checkpoint.filesystem as fs
        import torch.distributed.checkpoint.metadata as md

        allowed = {
            md.__name__: lambda o: inspect.isclass(o) and o.__module__ == md.__name__,
            fs.__name__: lambda o: o is fs._StorageInfo,
            "torch": lambda o: o is torch.Size or isinstance(o, torch.dtype),
            "torch.serialization": lambda o: o is torch.serialization._get_layout,
            "pathlib": lambda o: o in (pathlib.PosixPath, pathlib.PurePosixPath),
            "collections": lambda o: o is collections.OrderedDict,
        }
        module_obj = sys.modules.get(module) if module in allowed else None
        found = getattr(module_obj, name, None) if module_obj is not None else None
        if found is None or not allowed[module](found):
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")
        return found


def check_metadata(path: Path, source: str) -> None:
    """dcp/.metadata must be a regular file whose pickle names only checkpoint metadata
    (_MetadataUnpickler); else a CheckpointError, before torch loads it with pickle."""
    if path.is_symlink() or not path.is_file():
        raise CheckpointError(f"cannot resume from {source}: {DCP_DIR}/{METADATA} is not a file")
    try:
        with path.open("rb") as f:
            _MetadataUnpickler(f).load()
    except Exception as error:  # a hostile or damaged pickle fails in many ways
        raise CheckpointError(
            f"cannot resume from {source}: {DCP_DIR}/{METADATA} is not a checkpoint's "
            f"metadata ({type(error).__name__}: {error})"
        ) from None


def check_world(state: CheckpointState, source: str) -> None:
    """The world size that saved the checkpoint must be this one's."""
    saved = int(state.identity.trajectory_settings.get(WORLD_SIZE, 1))
    now = world().size
    if saved != now:
        raise ConfigError(
            f"cannot resume from {source}: it was saved by {saved} rank{'s' * (saved > 1)} and "
            f"this run has {now} (the world size changed); resume with torchrun "
            f"--nproc_per_node (x --nnodes) = {saved}"
        )


def restore_state(state: CheckpointState, source: str, named, optimizer) -> None:
    """The trained tensors and the optimizer's slots from dcp/, and this rank's generators,
    after run.restore put the one-process parts back (groups, position)."""
    import torch.distributed.checkpoint as dcp

    path = Path(source)
    path = path if path.suffix == ".state" else path.with_suffix(".state")
    folder = path / DCP_DIR
    if not folder.is_dir():
        raise CheckpointError(f"cannot resume from {source}: it holds no {DCP_DIR}/ folder")
    check_metadata(folder / METADATA, source)  # before torch unpickles it
    meta = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    params = dict(named)
    saved = {k.split("/", 1)[1] for k in meta if k.startswith("trained/")}
    if saved != set(params):
        diff = sorted(saved ^ set(params))[:5]
        raise CheckpointError(
            f"cannot resume from {source}: the trained parameters differ from the checkpoint's "
            f"(for example {', '.join(diff)})"
        )
    wanted: dict[str, torch.Tensor] = {}
    for key, m in meta.items():
        kind, rest = key.split("/", 1)
        if kind == "trained":
            wanted[key] = params[rest]
            continue
        name, slot = rest.rsplit("/", 1)
        p, dtype = params[name], m.properties.dtype
        like = tuple(m.size) == tuple(p.shape)  # a slot shaped (and sharded) as its parameter
        wanted[key] = torch.empty_like(p, dtype=dtype) if like else torch.empty(m.size, dtype=dtype)
    with torch.no_grad():
        dcp.load(wanted, checkpoint_id=str(folder))
    for key, value in wanted.items():
        if key.startswith("optimizer/"):
            name, slot = key.split("/", 1)[1].rsplit("/", 1)
            optimizer.state[params[name]][slot] = value
    _restore_generators(state, source)


def _restore_generators(state: CheckpointState, source: str) -> None:
    from retrograd.checkpoint import restore_rng

    name = rng_artifact(world().rank)
    if name not in state.artifacts:
        raise CheckpointError(f"cannot resume from {source}: it holds no {name}")
    generators = msgpack.unpackb(state.artifacts[name])
    restore_rng(RngState(generators=generators, seeds=dict(state.rng.seeds)))
