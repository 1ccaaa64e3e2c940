"""Checkpoints: `.state` directories written atomically, loaded for exact resume (docs/checkpoints.md).

The records (state.py) and the directory functions import no torch, so listing checkpoints
stays cheap; the torch bridges (optimizer slots, RNG states) load on first use.
"""

from retrograd.checkpoint.fingerprint import (
    ModelIdentity,
    file_fingerprint,
    model_fingerprint,
    model_identity,
    settings_signature,
)
from retrograd.checkpoint.layout import (
    CheckpointError,
    CheckpointInfo,
    latest_checkpoint,
    list_checkpoints,
    resolve_state_dir,
    step_id,
)
from retrograd.checkpoint.resume import check_resume
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
from retrograd.checkpoint.store import load_checkpoint, save_checkpoint

_TORCH_BRIDGES = {
    "optimizer_state": "retrograd.checkpoint.optim",
    "restore_optimizer": "retrograd.checkpoint.optim",
    "capture_rng": "retrograd.checkpoint.rng",
    "restore_rng": "retrograd.checkpoint.rng",
}


def __getattr__(name: str):
    if name in _TORCH_BRIDGES:
        import importlib

        return getattr(importlib.import_module(_TORCH_BRIDGES[name]), name)
    raise AttributeError(f"module 'retrograd.checkpoint' has no attribute {name!r}")


__all__ = [
    "FORMAT_VERSION",
    "AdapterState",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointState",
    "DatasetPosition",
    "Identity",
    "ModelIdentity",
    "OptimizerState",
    "Progress",
    "RngState",
    "SchedulerState",
    "Slot",
    "capture_rng",
    "check_resume",
    "file_fingerprint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "model_fingerprint",
    "model_identity",
    "optimizer_state",
    "resolve_state_dir",
    "restore_optimizer",
    "restore_rng",
    "save_checkpoint",
    "settings_signature",
    "step_id",
]
