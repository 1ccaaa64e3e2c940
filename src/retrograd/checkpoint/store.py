"""Save and load `.state` directories so that a kill at any moment loses nothing complete.

Saving `step-…` writes every file into `.step-….tmp-<pid>-<n>/` (manifest last, each file and
the directory flushed to disk), moves an existing `step-….state` aside to `.step-….backup`,
renames the new directory into place, removes the backup, and only then writes the sibling
adapter export `step-….gguf` (atomically, through a temporary file). At every instant either
the `.state` or its `.backup` is complete, and loading takes whichever is.
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from retrograd.checkpoint.codec import ADAPTER, read_state, write_state
from retrograd.checkpoint.layout import (
    CheckpointError,
    backup_path,
    check_id,
    export_path,
    is_complete,
    resolve_state_dir,
    state_path,
    sweep_temporaries,
)
from retrograd.checkpoint.state import CheckpointState
from retrograd.gguf import atomic_copy, write_lora_adapter
from retrograd.gguf.writer import fsync_dir

_COUNTER = itertools.count()


def save_checkpoint(
    directory: str | Path,
    checkpoint_id: str,
    state: CheckpointState,
    *,
    export_adapter: bool = True,
    fill: Callable[[Path], None] | None = None,
) -> Path:
    """Write `state` as `<directory>/<checkpoint_id>.state` atomically; returns that path.

    With `export_adapter` and an adapter in the state, also writes `<checkpoint_id>.gguf` beside
    it in the adapter's export dtype, after the directory has landed. `fill(tmp)` writes more
    files into the temporary directory first (a distributed run's ranks, distributed/); the
    manifest covers them.
    """
    step = check_id(checkpoint_id)
    if step is not None and step != state.global_step:
        raise CheckpointError(f"{checkpoint_id}: the state is at global step {state.global_step}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    sweep_temporaries(directory)
    tmp = directory / f".{checkpoint_id}.tmp-{os.getpid()}-{next(_COUNTER)}"
    tmp.mkdir()
    try:
        if fill is not None:
            fill(tmp)
        write_state(tmp, checkpoint_id, state)
        fsync_dir(tmp)
        final = _land(directory, checkpoint_id, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if export_adapter and state.adapter is not None:
        _export(directory, checkpoint_id, state, final)
    else:
        export_path(directory, checkpoint_id).unlink(missing_ok=True)  # would be stale
    return final


def _land(directory: Path, checkpoint_id: str, tmp: Path) -> Path:
    """Rename the finished `tmp` into place, keeping the old version as a backup meanwhile."""
    final, backup = state_path(directory, checkpoint_id), backup_path(directory, checkpoint_id)
    if final.exists() and not is_complete(final) and is_complete(backup):
        shutil.rmtree(final)  # not ours (we only rename complete ones); keep the good backup
    elif final.exists():
        # NOTE: a backup beside a complete .state is stale: the older of the two.
        shutil.rmtree(backup, ignore_errors=True)
        os.rename(final, backup)
    os.rename(tmp, final)
    fsync_dir(directory)
    shutil.rmtree(backup, ignore_errors=True)
    return final


def _export(directory: Path, checkpoint_id: str, state: CheckpointState, final: Path) -> None:
    adapter = state.adapter
    assert adapter is not None
    dst = export_path(directory, checkpoint_id)
    if adapter.dtype == "f32":
        atomic_copy(final / ADAPTER, dst)
        return
    write_lora_adapter(
        dst,
        architecture=state.architecture,
        tensors=adapter.tensors,
        alpha=adapter.alpha,
        dtype=adapter.dtype,
        name=checkpoint_id,
    )


def load_checkpoint(path: str | Path, *, verify: bool = True) -> CheckpointState:
    """Read a checkpoint from its `.state` directory or its sibling `.gguf` path.

    A `.state` cut short by a kill is replaced by its surviving backup; an incomplete directory
    (no manifest) is refused. `verify` checks every file's sha256 against the manifest.
    """
    return read_state(resolve_state_dir(path), verify=verify)
