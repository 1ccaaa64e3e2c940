"""Capture and restore random number generators, so a resumed run draws what it would have.

Most of a run's randomness derives from seeds and indices (seeds.py) and needs nothing here;
these are the stateful generators: torch's default CPU generator ("torch"), each CUDA device's
("cuda:0", ...) once CUDA is in use, Python's `random` ("python"), numpy's legacy global
generator ("numpy"), and any torch.Generator the loop names. States are stored as bytes.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

import msgpack
import numpy as np
import torch

from retrograd.checkpoint.layout import CheckpointError
from retrograd.checkpoint.state import RngState


def capture_rng(
    seeds: Mapping[str, int] | None = None,
    generators: Mapping[str, torch.Generator] | None = None,
) -> RngState:
    states = {"torch": _bytes(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            states[f"cuda:{i}"] = _bytes(s)
    version, internal, gauss = random.getstate()
    states["python"] = msgpack.packb([version, list(internal), gauss])
    name, keys, pos, has_gauss, cached = np.random.get_state()
    states["numpy"] = msgpack.packb([name, keys.tobytes(), pos, has_gauss, cached])
    for key, gen in (generators or {}).items():
        if key in states:
            raise ValueError(f"generator name {key!r} is reserved")
        states[key] = _bytes(gen.get_state())
    return RngState(generators=states, seeds=dict(seeds or {}))


def restore_rng(state: RngState, generators: Mapping[str, torch.Generator] | None = None) -> None:
    """Put every captured generator back; a named generator the checkpoint lacks is an error."""
    g = state.generators
    torch.set_rng_state(_tensor(g["torch"]))
    cuda = sorted(k for k in g if k.startswith("cuda:"))
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all([_tensor(g[k]) for k in cuda])
    version, internal, gauss = msgpack.unpackb(g["python"])
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = msgpack.unpackb(g["numpy"])
    np.random.set_state((name, np.frombuffer(keys, dtype=np.uint32), pos, has_gauss, cached))
    for key, gen in (generators or {}).items():
        if key not in g:
            raise CheckpointError(f"the checkpoint holds no state for generator {key!r}")
        gen.set_state(_tensor(g[key]))


def _bytes(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
