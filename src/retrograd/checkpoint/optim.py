"""A torch optimizer's state as named slots, and back, for exact resume.

`names` lists the optimizer's parameters in its own order (param_groups, then params), which
is the order of the integer keys of `state_dict()["state"]`. Every state tensor becomes a Slot
of raw bytes (bf16 included) owned by its parameter's name; hyper-parameters of each group are
kept with the group's parameter names. Restoring goes through `load_state_dict`, so a slot
lands on its parameter's device exactly as torch itself would put it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from retrograd.checkpoint.layout import CheckpointError
from retrograd.checkpoint.state import OptimizerState, Slot

DTYPES = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
}
_TORCH = {v: k for k, v in DTYPES.items()}


def optimizer_state(
    optimizer: torch.optim.Optimizer,
    names: Sequence[str],
    *,
    kind: str,
    hyper: Mapping[str, Any] | None = None,
    slots: bool = True,
) -> OptimizerState:
    """Capture `optimizer` (AdamW, SGD, ...) whose parameters are called `names`, in order;
    without `slots`, its groups alone (a distributed checkpoint keeps the slots elsewhere)."""
    sd = optimizer.state_dict()
    groups = []
    for g in sd["param_groups"]:
        params = [_name(names, i) for i in g["params"]]
        groups.append({**{k: _plain(v) for k, v in g.items() if k != "params"}, "params": params})
    if sum(len(g["params"]) for g in groups) != len(names):
        raise ValueError(f"{len(names)} names for an optimizer of a different parameter count")
    kept = []
    for index, per_param in sorted(sd["state"].items() if slots else ()):
        for slot, value in per_param.items():
            if value is None:
                continue  # SGD without momentum keeps momentum_buffer = None
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {names[index]}/{slot}: {type(value).__name__}")
            kept.append(_slot(kind, names[index], slot, value))
    return OptimizerState(kind, dict(hyper or {}), tuple(groups), tuple(kept))


def restore_optimizer(
    optimizer: torch.optim.Optimizer, names: Sequence[str], state: OptimizerState
) -> None:
    """Load `state` into a freshly built optimizer over the same parameters, named `names`."""
    saved = [p for g in state.groups for p in g["params"]]
    if list(saved) != list(names):
        missing = sorted(set(saved) ^ set(names))[:5]
        raise CheckpointError(
            "cannot resume: the trained parameters differ from the checkpoint's "
            f"(for example {', '.join(missing) or 'their order'})"
        )
    index = {n: i for i, n in enumerate(names)}
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for s in state.slots:
        # NOTE: load_state_dict does not check it; a checkpoint may be anyone's. A slot's
        # shape is the optimizer's business (Gefen keeps factored moments), not checked here.
        if s.owner not in index:
            raise CheckpointError(f"cannot resume: optimizer state for {s.owner!r}, not trained")
        per_param.setdefault(index[s.owner], {})[s.slot] = _tensor(s)
    groups = []
    for g in state.groups:
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in g.items() if k != "params"}
        groups.append({**values, "params": [index[n] for n in g["params"]]})
    optimizer.load_state_dict({"state": per_param, "param_groups": groups})


def _name(names: Sequence[str], i: int) -> str:
    if not 0 <= i < len(names):
        raise ValueError(f"optimizer parameter {i} has no name ({len(names)} names given)")
    return names[i]


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item()
    if isinstance(v, tuple):
        return list(v)
    return v


def _slot(scope: str, owner: str, slot: str, t: torch.Tensor) -> Slot:
    if t.dtype not in DTYPES:
        raise TypeError(f"optimizer state {owner}/{slot}: dtype {t.dtype} is not stored")
    raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return Slot(scope, owner, slot, DTYPES[t.dtype], tuple(t.shape), raw.numpy().tobytes())


def _tensor(s: Slot) -> torch.Tensor:
    if not s.data:
        return torch.empty(s.shape, dtype=_TORCH[s.dtype])
    raw = torch.frombuffer(bytearray(s.data), dtype=torch.uint8)
    return raw.view(_TORCH[s.dtype]).reshape(s.shape)
