"""What a loop leaves behind: metrics, checkpoints, resume and the final output.

Every loop (sft, preference, grpo, ppo, distill, agent_grpo) calls these functions at fixed
points with its own records: a `Mark` says where the loop stands (what a checkpoint keeps of
its position), a trajectory dict what of its section changes the steps, a values dict its
metrics. This module maps them to
observe/ (progress, TensorBoard, W&B) and checkpoint/ (run.py: .state directories and resume;
export.py: the final output). It reads the shared sections ([training], [lora], [checkpoint], [metrics], [output]),
never an algorithm's own section, and knows no training math.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from retrograd.checkpoint import CheckpointState, DatasetPosition, Progress, export, step_id
from retrograd.checkpoint import run as ckrun
from retrograd.checkpoint.run import RunIdentity
from retrograd.optim import base_lr
from retrograd.trainable.plan import Trained

__all__ = ["RunIdentity"]
_log = logging.getLogger(__name__)


@dataclass
class Mark:
    """What a checkpoint keeps of a loop's position: its step, the resume boundary (epoch or
    update), where it reads its data, loop-specific counters, and artifacts (callables giving
    bytes, called only when a checkpoint is written)."""

    global_step: int
    epoch: int = 0
    update: int = 0
    dataset: DatasetPosition = field(default_factory=lambda: DatasetPosition(0, 0))
    extra: dict = field(default_factory=dict)
    artifacts: dict[str, Callable[[], bytes]] = field(default_factory=dict)


class Legacy:
    """The one-object sinks of the loops not yet on the frame (algorithms/frame.py): a Door's
    sinks for the reports and its control for the boundary and the checkpoints."""

    def __init__(self, door):
        self.sinks, self.control = door.sinks, door.control
        self.console = getattr(door.sinks, "console", None)

    def __getattr__(self, name: str):  # resumed, step, note, warn, evaluation, finish, fail
        return getattr(self.sinks, name)

    def start(self, cfg, model, plan, total_steps: int, **kwargs) -> None:
        from types import SimpleNamespace

        from retrograd.algorithms.frame import start_info

        kwargs.setdefault("held", None)
        self.sinks.start(start_info(cfg, model, plan, total_steps, **kwargs))
        self.control.opened(SimpleNamespace(cfg=cfg, model=model, tr=SimpleNamespace(plan=plan)))

    def checkpoint(self, path: Path, global_step: int) -> None:
        self.sinks.checkpoint(path, global_step)
        self.control.checkpoint_written(path, global_step)

    def boundary(self, cfg, measure):
        return self.control.boundary(cfg, measure)

    def checkpoint_requested(self) -> bool:
        return self.control.checkpoint_requested()

    def checkpoint_section(self, cfg):
        return self.control.checkpoint_section(cfg)


def boundary(sinks: Legacy, cfg, patience, measure: Callable[[], dict | None]):
    """Every loop's one hook (Sinks.boundary) -> (cfg, rate): the config the run follows from
    here on and the base rate its schedule scales. A changed [training].lr replaces the base:
    the schedule goes on from the same step (a warm-up keeps warming up toward the new rate, a
    decay keeps decaying from it); a changed [evaluation].patience is the limit from now on."""
    cfg = sinks.boundary(cfg, measure)
    if cfg.evaluation is not None:
        patience.patience = cfg.evaluation.patience
    return cfg, base_lr(cfg.training, cfg.optimizer)


def export_or_keep(
    cfg, model, run_file, run, mark: Mark, named, optimizer, plan, adapters, patience, total
) -> Path:
    """The final export (checkpoint/export.py); when it fails the trained result is kept."""
    trained = adapters if isinstance(adapters, Trained) else Trained(adapters, [])
    state = lambda: _state(cfg, run, mark, named, optimizer, plan, patience, total)  # noqa: E731
    return export.export_or_keep(cfg, model, plan, trained, run_file, state, mark.global_step)


# -- checkpoints ---------------------------------------------------------------------------


def find_resume(cfg, resume):
    return ckrun.find_resume(cfg, resume)


def restore(found, run: RunIdentity, named, optimizer, patience) -> CheckpointState:
    """Put adapters, optimizer, RNGs and patience back (checkpoint/run.py)."""
    state = ckrun.restore(found, run, named, optimizer)
    if state.progress.best_metric is not None:
        patience.best = state.progress.best_metric
    patience.stale = state.progress.stale_evaluations
    return state


def _state(cfg, run, mark: Mark, named, optimizer, plan, patience, total: int) -> CheckpointState:
    best = patience.best if patience.best != float("inf") else None
    progress = Progress(
        mark.global_step, mark.epoch, mark.update, best, patience.stale, dict(mark.extra)
    )
    artifacts = {name: make() for name, make in mark.artifacts.items()}
    return ckrun.state_of(
        cfg, run, progress, mark.dataset, named, optimizer, plan, total, artifacts
    )


def maybe_checkpoint(
    cfg, run, mark: Mark, named, optimizer, plan, patience, total, sinks, before=None
) -> None:
    """A `steps` checkpoint when one is due at mark.global_step (or anywhere after `before`),
    or when the sinks ask for one."""
    before = mark.global_step - 1 if before is None else before
    ck = sinks.checkpoint_section(cfg)
    requested = ck is not None and sinks.checkpoint_requested()
    if not (ckrun.checkpoint_due(ck, before, mark.global_step) or requested):
        return
    state = _state(cfg, run, mark, named, optimizer, plan, patience, total)
    path = ckrun.save(ck.directory, step_id(mark.global_step), state, named, optimizer)
    sinks.checkpoint(path, mark.global_step)


def save_best(cfg, run, mark: Mark, named, optimizer, plan, patience, total, sinks) -> None:
    ck = sinks.checkpoint_section(cfg)
    if not ckrun.keeps_best(ck):
        return
    state = _state(cfg, run, mark, named, optimizer, plan, patience, total)
    path = ckrun.save(ck.directory, "best", state, named, optimizer)
    sinks.checkpoint(path, mark.global_step)
