"""The records a checkpoint holds: what exact resume needs, and what it must refuse.

Frozen dataclasses of numpy arrays, bytes and msgpack-able values; nothing here knows torch or
files. Arrays keep the dtype the trainer gave (adapter factors are float32), so a round trip
through a checkpoint is bit-exact. `extra` mappings carry a loop's own scalars (str, int,
float, bool, None, lists and dicts of those), stored by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from retrograd.checkpoint.fingerprint import settings_signature

FORMAT_VERSION = 1


@dataclass(frozen=True)
class Progress:
    """Where the run stands: the resume boundary and what early stopping has seen."""

    global_step: int
    epoch: int = 0  # completed epochs (SFT, preference); the resume boundary
    update: int = 0  # completed rollout updates (PPO, GRPO, agent)
    best_metric: float | None = None
    stale_evaluations: int = 0  # evaluations since the last improvement (patience)
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Identity:
    """What the run was made from; resume refuses a change of model, data, algorithm or
    trajectory settings (checkpoint.resume.check_resume)."""

    model_signature: str  # tensor layout: architecture, names, types, shapes
    model_bytes: int
    model_fingerprint: str  # content (checkpoint.fingerprint.model_identity)
    data_fingerprint: str
    algorithm: str
    trajectory_settings: Mapping[str, Any] = field(default_factory=dict)  # plain values only
    app_version: str = ""

    @property
    def trajectory_signature(self) -> str:
        return settings_signature(self.trajectory_settings)


@dataclass(frozen=True)
class SchedulerState:
    kind: str  # constant, linear, cosine
    step: int  # optimizer steps taken
    total_steps: int
    learning_rate: float  # the base rate
    warmup_steps: int
    last_learning_rate: float


@dataclass(frozen=True)
class Slot:
    """One optimizer state tensor (exp_avg of blk.0.attn_q.weight.lora_a), as raw bytes.

    Raw bytes because bf16 has no numpy dtype; `dtype` is f32, f16, bf16, f64, i64, ...
    """

    scope: str  # the optimizer that owns it (adamw, sgd)
    owner: str  # parameter name
    slot: str  # exp_avg, exp_avg_sq, step, momentum_buffer
    dtype: str
    shape: tuple[int, ...]
    data: bytes


@dataclass(frozen=True)
class OptimizerState:
    kind: str
    hyper: Mapping[str, Any]  # what the loop reports: lr, weight_decay, max_grad_norm, ...
    groups: tuple[Mapping[str, Any], ...]  # torch param_groups, "params" as parameter names
    slots: tuple[Slot, ...]

    @property
    def state_bytes(self) -> int:
        return sum(len(s.data) for s in self.slots)


@dataclass(frozen=True)
class RngState:
    """Generator states by name (torch, cuda:0, python, numpy, or the loop's own) and the
    run's named seeds {domain: u64}."""

    generators: Mapping[str, bytes] = field(default_factory=dict)
    seeds: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class DatasetPosition:
    epoch: int  # the epoch whose permutation is being read
    index: int  # next position within that epoch's permutation
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AdapterState:
    """LoRA factors {base tensor name: (A (r, n_in), B (n_out, r))} and how to export them."""

    rank: int
    alpha: float
    dtype: str  # dtype of the exported adapter (the sibling .gguf): f16 or f32
    tensors: Mapping[str, tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class CheckpointState:
    """Everything one checkpoint holds. `trainable` are trained base tensors, absolute values."""

    architecture: str
    progress: Progress
    identity: Identity
    scheduler: SchedulerState
    optimizer: OptimizerState
    rng: RngState
    dataset: DatasetPosition
    adapter: AdapterState | None = None
    trainable: Mapping[str, np.ndarray] | None = None
    trainable_plan: Mapping[str, Any] = field(default_factory=dict)
    artifacts: Mapping[str, bytes] = field(default_factory=dict)  # file name -> bytes

    @property
    def global_step(self) -> int:
        return self.progress.global_step
