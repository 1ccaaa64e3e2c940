"""Names in a checkpoint directory, and which checkpoints in it are complete.

```
<directory>/
  step-000000000100.state/    the checkpoint (manifest.msgpack inside = complete)
  step-000000000100.gguf      adapter export beside it, non-authoritative
  best.state/  best.gguf
  .step-000000000100.tmp-<pid>-<n>/   being written (ignored; swept once its writer is gone)
  .step-000000000100.backup/          the previous version while a new one lands
```
A `.state` whose rename was cut short survives as its `.backup`, which every function here uses
in its place. This module reads names and manifests; store.py writes.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

import msgpack

from retrograd.errors import CheckpointError

MANIFEST = "manifest.msgpack"
STATE_SUFFIX = ".state"
_ID = re.compile(r"^(?:step-(\d{12})|best)$")
_TEMP = re.compile(r"^\..+\.tmp-(\d+)-\d+$")


def step_id(global_step: int) -> str:
    return f"step-{global_step:012d}"


def check_id(checkpoint_id: str) -> int | None:
    """The global step a `step-…` id names (None for `best`); anything else is refused."""
    m = _ID.match(checkpoint_id)
    if not m:
        raise CheckpointError(
            f"checkpoint id {checkpoint_id!r}: must be step-<12 digits> (step-000000000100) or best"
        )
    return int(m.group(1)) if m.group(1) else None


def state_path(directory: Path, checkpoint_id: str) -> Path:
    return directory / (checkpoint_id + STATE_SUFFIX)


def backup_path(directory: Path, checkpoint_id: str) -> Path:
    return directory / f".{checkpoint_id}.backup"


def export_path(directory: Path, checkpoint_id: str) -> Path:
    return directory / f"{checkpoint_id}.gguf"


def is_complete(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def resolve_state_dir(path: str | Path) -> Path:
    """The directory holding the data of a `.state` path, its sibling `.gguf`, or its backup."""
    path = Path(path)
    if path.suffix == ".gguf":
        path = path.with_suffix(STATE_SUFFIX)
    if path.suffix != STATE_SUFFIX:
        raise CheckpointError(f"{path}: not a checkpoint (expected a .state directory or .gguf)")
    checkpoint_id = path.name[: -len(STATE_SUFFIX)]
    backup = backup_path(path.parent, checkpoint_id)
    if is_complete(path):
        return path
    if is_complete(backup):
        return backup
    if path.is_dir():
        raise CheckpointError(
            f"{path}: incomplete checkpoint (no {MANIFEST}; it was cut short while being written)"
        )
    raise CheckpointError(f"{path}: no such checkpoint")


@dataclass(frozen=True)
class CheckpointInfo:
    id: str
    path: Path  # the .state path (its data may sit in the surviving backup)
    kind: str  # step or best
    global_step: int | None
    bytes: int
    complete: bool
    adapter: Path | None  # the sibling .gguf export, when present
    written_at: float | None  # unix seconds, from the manifest


def list_checkpoints(directory: str | Path) -> list[CheckpointInfo]:
    """Every checkpoint of a directory, newest (highest step) first, best last."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    ids = set()
    for entry in directory.iterdir():
        name = entry.name
        if name.endswith(STATE_SUFFIX):
            ids.add(name[: -len(STATE_SUFFIX)])
        elif name.startswith(".") and name.endswith(".backup"):
            ids.add(name[1 : -len(".backup")])
    infos = [_info(directory, i) for i in ids if _ID.match(i)]
    return sorted(infos, key=lambda c: (c.kind == "step", c.global_step or 0), reverse=True)


def _info(directory: Path, checkpoint_id: str) -> CheckpointInfo:
    path = state_path(directory, checkpoint_id)
    try:
        where = resolve_state_dir(path)
        complete = True
    except CheckpointError:
        where, complete = path, False
    manifest = {}
    if complete:
        try:
            manifest = read_manifest(where)
        except CheckpointError:  # one damaged checkpoint must not fail the whole listing
            complete = False
    step = check_id(checkpoint_id)
    sibling = export_path(directory, checkpoint_id)
    saved_step, written_at = manifest.get("global_step", step), manifest.get("written_at")
    return CheckpointInfo(
        id=checkpoint_id,
        path=path,
        kind="best" if step is None else "step",
        global_step=saved_step if _whole(saved_step) else step,
        bytes=_bytes(where),
        complete=complete,
        adapter=sibling if sibling.is_file() else None,
        written_at=float(written_at) if _number(written_at) else None,  # unix seconds
    )


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: object) -> bool:
    """A time a manifest can hold: seconds from 1970 to about the year 5000."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return ok and math.isfinite(value) and 0 <= value < 1e11


def _bytes(directory: Path) -> int:
    """The size of the regular files under `directory`, links not followed."""
    total = 0
    for folder, _, files in os.walk(directory):  # followlinks=False
        for name in files:
            st = os.lstat(os.path.join(folder, name))
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def latest_checkpoint(directory: str | Path) -> Path | None:
    """What resume picks: the complete step checkpoint of highest step, else best, else None."""
    complete = [c for c in list_checkpoints(directory) if c.complete]
    steps = [c for c in complete if c.kind == "step"]
    if steps:
        return steps[0].path
    best = [c for c in complete if c.kind == "best"]
    return best[0].path if best else None


MAX_MANIFEST_BYTES = 64 << 20  # a manifest lists files: megabytes at most


def read_manifest(path: Path) -> dict:
    """The manifest of the checkpoint at `path`: a regular file (not a link: a checkpoint may
    come from anyone) of at most MAX_MANIFEST_BYTES; else a CheckpointError."""
    file = path / MANIFEST
    if file.is_symlink() or (file.exists() and not file.is_file()):
        raise CheckpointError(f"{file}: unreadable manifest (not a regular file)")
    try:
        if file.stat().st_size > MAX_MANIFEST_BYTES:
            raise CheckpointError(
                f"{file}: unreadable manifest (over {MAX_MANIFEST_BYTES >> 20} MiB)"
            )
        manifest = msgpack.unpackb(file.read_bytes(), raw=False, strict_map_key=False)
    except (OSError, ValueError, msgpack.UnpackException) as e:
        raise CheckpointError(f"{path / MANIFEST}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path / MANIFEST}: unreadable manifest (not a map)")
    return manifest


def sweep_temporaries(directory: Path) -> None:
    """Remove what writers killed mid-write left behind (temporaries of processes now gone)."""
    for entry in directory.iterdir():
        m = _TEMP.match(entry.name)
        if m and not _alive(int(m.group(1))):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # ours, left by an earlier call that failed; no write is in flight
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
