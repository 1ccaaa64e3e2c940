"""A CheckpointState as the files of one `.state` directory, and back.

Every record is a msgpack map with named fields. `adapter.gguf` always holds the factors in
f32 (exact resume; the f16 export is the sibling .gguf), `trainable.gguf` the trained base
tensors as given, `optimizer-state.bin` the optimizer slots back to back (little-endian),
located by `optimizer.msgpack`. The manifest lists every other file with its size and sha256
and is written last. This module writes into a directory it is given; atomicity is store.py's.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path, PurePosixPath
from typing import Any

import msgpack
import numpy as np

from retrograd.checkpoint.layout import MANIFEST, CheckpointError, read_manifest
from retrograd.checkpoint.state import (
    FORMAT_VERSION,
    AdapterState,
    CheckpointState,
    DatasetPosition,
    Identity,
    OptimizerState,
    Progress,
    RngState,
    SchedulerState,
    Slot,
)
from retrograd.gguf import GGUFFile, write_gguf, write_lora_adapter
from retrograd.gguf.writer import fsync_dir
from retrograd.version import __version__

ADAPTER, TRAINABLE, OPTIMIZER_BIN, ARTIFACTS = (
    "adapter.gguf",
    "trainable.gguf",
    "optimizer-state.bin",
    "artifacts",
)
RECORDS = ("progress.msgpack", "scheduler.msgpack", "rng.msgpack", "dataset.msgpack")
RECORDS += ("optimizer.msgpack",)
SLOT_ITEMSIZE = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "i64": 8, "i32": 4, "i16": 2}
SLOT_ITEMSIZE |= {"i8": 1, "u8": 1, "bool": 1}
_GGUF_NUMPY = {"F32": np.float32, "F16": np.float16}


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


# -- writing ----------------------------------------------------------------------------------


def write_state(directory: Path, checkpoint_id: str, state: CheckpointState) -> None:
    """Write every file of `state` into the (empty) `directory`; the manifest comes last."""
    manifest: dict[str, Any] = {"adapter": None, "trainable": None}
    if state.adapter is not None:
        manifest["adapter"] = _write_adapter(directory, checkpoint_id, state)
    if state.trainable:
        manifest["trainable"] = _write_trainable(directory, checkpoint_id, state)
    _write_optimizer(directory, state.optimizer)
    _write(directory / "progress.msgpack", pack(asdict(state.progress)))
    _write(directory / "scheduler.msgpack", pack(asdict(state.scheduler)))
    _write(directory / "rng.msgpack", pack(asdict(state.rng)))
    _write(directory / "dataset.msgpack", pack(asdict(state.dataset)))
    _write_artifacts(directory, state.artifacts)
    manifest |= _manifest(directory, checkpoint_id, state)
    _write(directory / MANIFEST, pack(manifest))


def _write_adapter(directory: Path, checkpoint_id: str, state: CheckpointState) -> dict:
    a = state.adapter
    assert a is not None
    write_lora_adapter(
        directory / ADAPTER,
        architecture=state.architecture,
        tensors=a.tensors,
        alpha=a.alpha,
        dtype="f32",
        name=checkpoint_id,
    )
    return {"file": ADAPTER, "rank": a.rank, "alpha": a.alpha, "dtype": a.dtype}


def _write_trainable(directory: Path, checkpoint_id: str, state: CheckpointState) -> dict:
    tensors = {n: np.ascontiguousarray(x) for n, x in (state.trainable or {}).items()}
    for name, x in tensors.items():
        if x.dtype not in (np.float32, np.float16):
            raise CheckpointError(f"trainable tensor {name}: dtype {x.dtype}, expected f32 or f16")
    path = write_gguf(
        directory / TRAINABLE,
        architecture=state.architecture,
        metadata={"general.type": "retrograd.trainable", "general.name": checkpoint_id},
        tensors=tensors,
    )
    rows = [
        [n, "base", "f32" if x.dtype == np.float32 else "f16", list(x.shape), x.size, x.nbytes]
        for n, x in tensors.items()
    ]
    size = path.stat().st_size
    return {"file": TRAINABLE, "bytes": size, "fingerprint": _sha256(path), "tensors": rows}


def _write_optimizer(directory: Path, opt: OptimizerState) -> None:
    rows, offset = [], 0
    with open(directory / OPTIMIZER_BIN, "wb") as f:
        for s in opt.slots:
            f.write(s.data)
            rows.append([s.scope, s.owner, s.slot, s.dtype, list(s.shape), offset, len(s.data)])
            offset += len(s.data)
        f.flush()
        os.fsync(f.fileno())
    assignment = [[p, opt.kind] for g in opt.groups for p in g["params"]]
    record = {
        "kind": opt.kind,
        "hyper": dict(opt.hyper),
        "groups": [dict(g) for g in opt.groups],
        "slots": rows,
        "assignment": assignment,
        "state_bytes": offset,
    }
    _write(directory / "optimizer.msgpack", pack(record))


def _write_artifacts(directory: Path, artifacts: Mapping[str, bytes]) -> None:
    if not artifacts:
        return
    (directory / ARTIFACTS).mkdir()
    for name, data in artifacts.items():
        if not name or "/" in name or name.startswith("."):
            raise CheckpointError(f"artifact name {name!r}: must be a plain file name")
        _write(directory / ARTIFACTS / name, data)
    fsync_dir(directory / ARTIFACTS)


def _manifest(directory: Path, checkpoint_id: str, state: CheckpointState) -> dict:
    files = {}
    for f in sorted(directory.rglob("*")):
        if f.is_file():
            rel = f.relative_to(directory).as_posix()
            files[rel] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
    ident = state.identity
    return {
        "format_version": FORMAT_VERSION,
        "checkpoint_id": checkpoint_id,
        "global_step": state.global_step,
        "architecture": state.architecture,
        "trainable_policy": dict(state.trainable_plan),
        "files": files,
        "app_version": ident.app_version or __version__,
        "model_signature": ident.model_signature,
        "model_bytes": ident.model_bytes,
        "model_fingerprint": ident.model_fingerprint,
        "data_fingerprint": ident.data_fingerprint,
        "algorithm": ident.algorithm,
        "trajectory_signature": ident.trajectory_signature,
        "trajectory_settings": dict(ident.trajectory_settings),
        "resume_boundary": {"epoch": state.progress.epoch, "update": state.progress.update},
        "artifacts": sorted(state.artifacts),
        "written_at": time.time(),
    }


# -- reading ----------------------------------------------------------------------------------


def read_state(directory: Path, *, verify: bool = True) -> CheckpointState:
    """Read a complete `.state` directory; sizes (and with `verify`, sha256) are checked. A
    record of the wrong shape (a field missing or unknown, a value of the wrong type), or a
    file named out of the directory, is a CheckpointError naming the checkpoint: what it
    holds may have been written by anyone."""
    manifest = read_manifest(directory)
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{directory}: checkpoint format version {version}; this Retrograd reads {FORMAT_VERSION}"
        )
    try:
        _check_files(directory, manifest["files"], verify)
        return _state(directory, manifest)
    except _Malformed as e:
        cause = e.__cause__
        raise CheckpointError(
            f"{directory}: malformed checkpoint: {e.args[0]}: {type(cause).__name__}: {cause}"
        ) from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(
            f"{directory}: malformed checkpoint: {MANIFEST}: {type(e).__name__}: {e}"
        ) from None


class _Malformed(Exception):
    """A record of a checkpoint that does not read as its type; args[0] names the file."""


def _state(directory: Path, manifest: dict) -> CheckpointState:
    for name in manifest["artifacts"]:
        _inside(name, ARTIFACTS)
    adapter = manifest["adapter"]
    read = [*RECORDS, OPTIMIZER_BIN, *(f"{ARTIFACTS}/{n}" for n in manifest["artifacts"])]
    read += [adapter["file"]] if adapter is not None else []
    read += [TRAINABLE] if manifest["trainable"] else []
    for rel in read:  # what the manifest vouches for (_check_files) is all that is opened
        _inside(rel)
        if rel not in manifest["files"]:
            raise ValueError(f"{rel!r} is read but not listed in the manifest's files")
    return CheckpointState(
        architecture=manifest["architecture"],
        progress=_typed(directory, "progress.msgpack", Progress),
        identity=_identity(manifest),
        scheduler=_typed(directory, "scheduler.msgpack", SchedulerState),
        optimizer=_read_optimizer(directory),
        rng=_typed(directory, "rng.msgpack", RngState),
        dataset=_typed(directory, "dataset.msgpack", DatasetPosition),
        adapter=_read_adapter(directory, manifest["adapter"]),
        trainable=_read_trainable(directory) if manifest["trainable"] else None,
        trainable_plan=manifest["trainable_policy"],
        artifacts={n: (directory / ARTIFACTS / n).read_bytes() for n in manifest["artifacts"]},
    )


def _inside(rel: str, where: str = "") -> None:
    """ValueError unless `rel` names a file inside the checkpoint (relative, no `..`)."""
    pure = PurePosixPath(f"{where}/{rel}" if where else rel) if isinstance(rel, str) else None
    if pure is None or pure.is_absolute() or ".." in pure.parts:
        raise ValueError(f"{rel!r} names a file outside the checkpoint")


def _check_files(directory: Path, files: dict, verify: bool) -> None:
    """Each listed file is a regular file inside the directory (no link on its way: the
    checkpoint may come from anyone), of its size and, with `verify`, its sha256."""
    root = directory.resolve()
    for rel, meta in files.items():
        _inside(rel)
        path = directory / rel
        if any((directory / part).is_symlink() for part in _prefixes(rel)):
            raise ValueError(f"{rel!r} is a link (a checkpoint's files are its own)")
        if not path.resolve().is_relative_to(root):
            raise ValueError(f"{rel!r} names a file outside the checkpoint")
        if not path.is_file() or path.stat().st_size != meta["bytes"]:
            raise CheckpointError(
                f"{path}: missing or of the wrong size; the checkpoint is damaged"
            )
        if verify and _sha256(path) != meta["sha256"]:
            raise CheckpointError(f"{path}: content differs from the manifest (sha256)")


def _prefixes(rel: str) -> list[str]:
    """ "a/b/c" -> ["a", "a/b", "a/b/c"]: each path a file's own path passes through."""
    parts = PurePosixPath(rel).parts
    return ["/".join(parts[: k + 1]) for k in range(len(parts))]


def _record(directory: Path, name: str) -> dict:
    try:
        record = unpack((directory / name).read_bytes())
    except (ValueError, msgpack.UnpackException) as e:
        raise _Malformed(name) from e
    if not isinstance(record, dict):
        raise _Malformed(name) from TypeError("not a map")
    return record


def _typed(directory: Path, name: str, kind: type):
    """kind(**the record `name`); _Malformed naming it when its fields are not kind's."""
    try:
        return kind(**_record(directory, name))
    except TypeError as e:
        raise _Malformed(name) from e


def _identity(m: dict) -> Identity:
    return Identity(
        model_signature=m["model_signature"],
        model_bytes=m["model_bytes"],
        model_fingerprint=m["model_fingerprint"],
        data_fingerprint=m["data_fingerprint"],
        algorithm=m["algorithm"],
        trajectory_settings=m["trajectory_settings"],
        app_version=m["app_version"],
    )


def _read_optimizer(directory: Path) -> OptimizerState:
    rec = _record(directory, "optimizer.msgpack")
    blob = (directory / OPTIMIZER_BIN).read_bytes()
    slots = []
    try:
        for scope, owner, slot, dtype, shape, offset, n_bytes in rec["slots"]:
            sizes = [offset, *shape]
            if not all(isinstance(n, int) and n >= 0 for n in sizes):
                raise ValueError(f"slot {owner}/{slot}: offset and shape must be integers >= 0")
            expected = math.prod(shape) * SLOT_ITEMSIZE.get(dtype, -1)
            if n_bytes != expected or offset + n_bytes > len(blob):
                raise CheckpointError(f"{directory}: optimizer slot {owner}/{slot} is malformed")
            data = blob[offset : offset + n_bytes]
            slots.append(Slot(scope, owner, slot, dtype, tuple(shape), data))
        groups = tuple(rec["groups"])
        return OptimizerState(rec["kind"], rec["hyper"], groups, tuple(slots))
    except (KeyError, TypeError, ValueError) as e:
        raise _Malformed("optimizer.msgpack") from e


def _gguf_arrays(path: Path) -> dict[str, np.ndarray]:
    g = GGUFFile(path)
    out = {}
    for name, info in g.tensors.items():
        dtype = _GGUF_NUMPY.get(info.type_name)
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name} is {info.type_name}, expected F32/F16")
        out[name] = info.data.view(dtype).reshape(info.shape).copy()
    return out


def _read_adapter(directory: Path, meta: dict | None) -> AdapterState | None:
    if meta is None:
        return None
    arrays = _gguf_arrays(directory / meta["file"])
    bases = sorted(n[: -len(".lora_a")] for n in arrays if n.endswith(".lora_a"))
    tensors = {b: (arrays[b + ".lora_a"], arrays[b + ".lora_b"]) for b in bases}
    return AdapterState(meta["rank"], meta["alpha"], meta["dtype"], tensors)


def _read_trainable(directory: Path) -> dict[str, np.ndarray]:
    return _gguf_arrays(directory / TRAINABLE)
