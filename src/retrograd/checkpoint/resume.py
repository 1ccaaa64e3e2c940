"""Whether a checkpoint may be resumed by this run, and if not, exactly what changed.

Resume continues a trajectory; it is refused when the model's content, the data, the algorithm
or any setting that affects the trajectory differs from the checkpoint's. Settings are compared
key by key, so the message names each one. Settings that do not affect the trajectory (device,
max_gpu_duty_cycle, logging) are the loop's to leave out of the mapping.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from retrograd.checkpoint.fingerprint import settings_signature
from retrograd.checkpoint.state import CheckpointState
from retrograd.errors import ConfigError

_MISSING = object()


def check_resume(
    state: CheckpointState,
    *,
    model_fingerprint: str,
    data_fingerprint: str,
    algorithm: str,
    trajectory_settings: Mapping[str, Any],
    source: str = "the checkpoint",
) -> None:
    """Raise ConfigError listing every difference between the checkpoint's run and this one."""
    ident = state.identity
    changes = []
    if ident.model_fingerprint != model_fingerprint:
        changes.append(
            "the model changed (checkpoint was made with a model of fingerprint "
            f"{_short(ident.model_fingerprint)}, this run's is {_short(model_fingerprint)})"
        )
    if ident.data_fingerprint != data_fingerprint:
        changes.append(
            f"the training data changed (fingerprint {_short(ident.data_fingerprint)} in the "
            f"checkpoint, {_short(data_fingerprint)} now)"
        )
    if ident.algorithm != algorithm:
        changes.append(
            f"the algorithm changed ({ident.algorithm} in the checkpoint, {algorithm} now)"
        )
    if ident.trajectory_signature != settings_signature(trajectory_settings):
        diffs = "; ".join(settings_diff(ident.trajectory_settings, trajectory_settings))
        changes.append(f"settings that shape the trajectory changed: {diffs}")
    if changes:
        raise ConfigError(f"cannot resume from {source}: " + "; and ".join(changes))


def settings_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """`key: old -> new` for each flattened key whose value differs."""
    a, b = _flatten(old), _flatten(new)
    out = []
    for key in sorted(a.keys() | b.keys()):
        va, vb = a.get(key, _MISSING), b.get(key, _MISSING)
        if _same(va, vb):
            continue
        out.append(f"{key}: {_show(va)} -> {_show(vb)}")
    return out


def _flatten(m: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in m.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out |= _flatten(v, key)
        else:
            out[key] = v
    return out


def _same(a: Any, b: Any) -> bool:
    # msgpack returns lists where the loop may pass tuples.
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a is not _MISSING and b is not _MISSING and type(a) is type(b) and a == b


def _show(v: Any) -> str:
    return "(unset)" if v is _MISSING else repr(v)


def _short(fingerprint: str) -> str:
    digest = fingerprint.split(":", 1)[-1]
    return digest[:12] + "…" if len(digest) > 12 else digest
