"""A training run's checkpoints: what identifies the run, the state it saves, and its restore.

The frame (algorithms/frame.py) calls these with records it builds: `RunIdentity` (what a
checkpoint must match to be resumed), a `Progress` and a `DatasetPosition` (where the loop
stands), the trained (name, Parameter) pairs and their optimizer. This module reads the
shared sections ([training], [optimizer], [checkpoint]) and never an algorithm's; it knows no
patience, no sinks and no loop. One process writes a checkpoint; the ranks of a distributed
run write it together (ranks.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from retrograd.checkpoint.fingerprint import ModelIdentity, model_identity, settings_signature
from retrograd.checkpoint.layout import CheckpointError, latest_checkpoint
from retrograd.checkpoint.optim import optimizer_state, restore_optimizer
from retrograd.checkpoint.ranks import WORLD_SIZE, check_world, restore_state, save_state
from retrograd.checkpoint.resume import check_resume
from retrograd.checkpoint.rng import capture_rng, restore_rng
from retrograd.checkpoint.state import (
    AdapterState,
    CheckpointState,
    DatasetPosition,
    Identity,
    Progress,
    SchedulerState,
)
from retrograd.checkpoint.store import load_checkpoint, save_checkpoint
from retrograd.distributed import world
from retrograd.errors import ConfigError
from retrograd.optim import base_lr, lr_at
from retrograd.version import __version__


@dataclass(frozen=True)
class RunIdentity:
    """What a checkpoint must match to be resumed by this run, and how to describe the run."""

    architecture: str
    model: ModelIdentity
    data_fingerprint: str
    algorithm: str
    trajectory: dict  # settings that change which steps happen and what they compute

    @classmethod
    def of(cls, cfg, architecture: str, data: dict, plan, algorithm_settings: dict) -> RunIdentity:
        """data: {role: fingerprint} of the files read; algorithm_settings: the loop's own
        settings that change its steps (its section's keys)."""
        t = cfg.training
        trajectory = {
            "ctx": t.ctx,
            "micro_batch": t.micro_batch,
            "gradient_accumulation": t.gradient_accumulation,
            "epochs": t.epochs,
            "lr": t.lr,
            "base_lr": base_lr(t, cfg.optimizer),
            "lr_scheduler": t.lr_scheduler,
            "warmup_steps": t.warmup_steps,
            "optimizer": t.optimizer,
            "weight_decay": t.weight_decay,
            "max_grad_norm": t.max_grad_norm,
            **algorithm_settings,
            **plan.signature(),
        }
        tables = cfg.optimizer
        section = getattr(tables, t.optimizer, None) if tables is not None else None
        if section is not None:  # [optimizer.muon] or [optimizer.gefen]: e.g. gefen's variant
            trajectory[t.optimizer] = section.model_dump()
        if world().active:  # a checkpoint resumes with the world size that saved it
            trajectory[WORLD_SIZE] = world().size
        return cls(
            architecture,
            model_identity(cfg.model.path),
            settings_signature(data),
            cfg.run.algorithm,
            json.loads(json.dumps(trajectory, default=str)),
        )

    @property
    def optimizer(self) -> str:
        return str(self.trajectory["optimizer"])


def find_resume(cfg, resume) -> tuple[CheckpointState, str] | None:
    """The checkpoint `train --resume [path]` or [checkpoint].resume_from names, loaded."""
    ck = cfg.checkpoint
    target = resume if resume not in (None, False) else (ck.resume_from if ck else None)
    if target is None:
        return None
    if target is True:
        if ck is None:
            raise ConfigError("--resume without a path needs [checkpoint].directory")
        latest = latest_checkpoint(ck.directory)
        if latest is None:
            raise ConfigError(f"--resume: no complete checkpoint in {ck.directory}")
        target = latest
    return load_checkpoint(target), str(target)


def restore(
    found: tuple[CheckpointState, str], run: RunIdentity, named, optimizer
) -> CheckpointState:
    """Put the trained tensors, optimizer and RNGs back, after checking the checkpoint belongs
    to this run; the caller reads its position, patience and artifacts from the state."""
    state, source = found
    check_world(state, source)
    if state.optimizer.kind != run.optimizer:
        raise ConfigError(
            f"cannot resume from {source}: the optimizer changed "
            f"({state.optimizer.kind} in the checkpoint, {run.optimizer} now)"
        )
    check_resume(
        state,
        model_fingerprint=run.model.fingerprint,
        data_fingerprint=run.data_fingerprint,
        algorithm=run.algorithm,
        trajectory_settings=run.trajectory,
        source=source,
    )
    tensors = state.adapter.tensors if state.adapter else {}
    base = state.trainable or {}
    with torch.no_grad():
        for name, param in named if not world().active else ():  # ranks: from dcp/ below
            stem, half = name.rsplit(".", 1)
            if half in ("lora_a", "lora_b"):
                a, b = tensors.get(stem, (None, None))
                value = a if half == "lora_a" else b
            else:
                value = base.get(name)  # a trained base tensor (f32, or its f16 values)
            if value is None or tuple(value.shape) != tuple(param.shape):
                # NOTE: copy_ would broadcast a wrong shape; the checkpoint may be anyone's
                got = "missing" if value is None else f"of shape {tuple(value.shape)}"
                raise CheckpointError(
                    f"cannot resume from {source}: {name} is {got}, the run's is "
                    f"{tuple(param.shape)}"
                )
            param.copy_(torch.from_numpy(np.ascontiguousarray(value)).to(param.dtype))
    restore_optimizer(optimizer, [n for n, _ in named], state.optimizer)
    restore_rng(state.rng)
    if world().active:
        restore_state(state, source, named, optimizer)
    return state


def state_of(
    cfg,
    run: RunIdentity,
    progress: Progress,
    dataset: DatasetPosition,
    named,
    optimizer,
    plan,
    total: int,
    artifacts: Mapping[str, bytes],
) -> CheckpointState:
    """What a checkpoint keeps at `progress`: the trained tensors, the optimizer, the schedule
    (of `total` steps, at the rate cfg follows now), the RNGs, the data position, artifacts."""
    t = cfg.training
    rate = base_lr(t, cfg.optimizer)
    step = progress.global_step
    lr = lr_at(max(0, step - 1), total, rate, t.lr_scheduler, t.warmup_steps)
    tensors = adapter_arrays(named)  # fsdp2: gathers, in the same order on every rank
    base = {n: checkpoint_array(p) for n, p in named if not n.endswith((".lora_a", ".lora_b"))}
    return CheckpointState(
        architecture=run.architecture,
        progress=progress,
        identity=Identity(
            run.model.signature,
            run.model.bytes,
            run.model.fingerprint,
            run.data_fingerprint,
            run.algorithm,
            # the rate the run follows now: a served run's [training].lr may change mid-run
            {**run.trajectory, "lr": t.lr, "base_lr": rate},
            __version__,
        ),
        scheduler=SchedulerState(t.lr_scheduler, step, total, rate, t.warmup_steps, lr),
        optimizer=optimizer_state(
            optimizer,
            [n for n, _ in named],
            kind=t.optimizer,
            hyper={"lr": t.lr, "weight_decay": t.weight_decay, "max_grad_norm": t.max_grad_norm},
            slots=not world().active,  # a distributed checkpoint's slots are in its dcp/
        ),
        rng=capture_rng(seeds={"lora": plan.seed}),
        dataset=dataset,
        adapter=AdapterState(plan.rank, plan.alpha, plan.dtype, tensors) if plan.rank else None,
        trainable=base or None,
        trainable_plan=plan.as_dict(),
        artifacts=dict(artifacts),
    )


def adapter_arrays(named) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{base tensor name: (A, B)} float32 arrays from trained (name, parameter) pairs (base
    tensors among them are skipped)."""
    halves: dict[str, dict[str, np.ndarray]] = {}
    for name, param in named:
        base, half = name.rsplit(".", 1)  # blk.0.attn_q.weight, lora_a
        if half in ("lora_a", "lora_b"):
            halves.setdefault(base, {})[half] = whole(param).float().cpu().numpy()
    return {base: (h["lora_a"], h["lora_b"]) for base, h in halves.items()}


def checkpoint_array(param: torch.Tensor) -> np.ndarray:
    """A trained base tensor as a checkpoint keeps it, exactly: f32 or f16 as it is, bf16
    widened to f32 (bf16 -> f32 -> bf16 loses nothing)."""
    p = whole(param).cpu()
    return p.numpy() if p.dtype in (torch.float32, torch.float16) else p.float().numpy()


def whole(param: torch.Tensor) -> torch.Tensor:
    """A trained tensor's full value, detached: fsdp2's shards gathered (every rank calls)."""
    p = param.detach()
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def checkpoint_due(section, before: int, after: int) -> bool:
    """Whether a `steps` checkpoint of [checkpoint] `section` falls in optimizer steps
    (before, after]: a loop that makes several steps between two points where it can stop
    checks them at once."""
    if section is None or section.mode not in ("steps", "steps_and_best_eval"):
        return False
    return after // section.every_steps > before // section.every_steps


def keeps_best(section) -> bool:
    """Whether [checkpoint] `section` keeps a `best` checkpoint of the evaluations."""
    return section is not None and section.mode in ("best_eval", "steps_and_best_eval")


def save(directory, checkpoint_id: str, state: CheckpointState, named, optimizer) -> Path:
    """One process writes the checkpoint; several ranks write it together (ranks.py)."""
    if world().active:
        return save_state(directory, checkpoint_id, state, named, optimizer)
    return save_checkpoint(directory, checkpoint_id, state)
