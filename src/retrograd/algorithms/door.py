"""What a caller brings to a training loop: the `Door` (sinks, a served run's control, hooks,
resume, the run file, and what Python gives as objects: a loaded model, trained tensors,
reward functions, an agent environment and verify function). The command line, the run
server and the Python API differ only in the door they pass; the loops and the frame
(frame.py) read it and never ask who called.

A served run's commands are a `Control` (server/child.py's ServerControl); a run nobody
steers has UNCONTROLLED. `Hooks` are a caller's callbacks at the frame's one boundary.
Knows no loop and no model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

from retrograd.observe.sinks import Sinks


class Control(Protocol):
    """A served run's commands (server/child.py); the command line and Python have none."""

    def opened(self, run) -> None:
        """The run is open (model loaded, position restored): before its first step."""

    def boundary(self, cfg, measure: Callable[[], dict | None]):
        """After a step's (or an update's) report: act on what was asked meanwhile (pause,
        checkpoint, stop, questions answered with the weights as they are: `measure()` is the
        loop's own evaluation without patience, {field: value}, or None without evaluation
        data). -> the config the run follows from here on. May block (pause) or raise."""

    def checkpoint_requested(self) -> bool:
        """Whether a checkpoint is wanted at this boundary though none is due."""

    def checkpoint_section(self, cfg):
        """The [checkpoint] the run follows now: the file's, or what a client changed."""

    def checkpoint_written(self, path: Path, global_step: int) -> None:
        """A checkpoint was written (after the sinks heard of it). May raise to end the run."""


class Uncontrolled:
    """The control of a run nobody steers: the file's settings, no commands."""

    def opened(self, run) -> None:
        pass

    def boundary(self, cfg, measure):
        return cfg

    def checkpoint_requested(self) -> bool:
        return False

    def checkpoint_section(self, cfg):
        return cfg.checkpoint

    def checkpoint_written(self, path: Path, global_step: int) -> None:
        pass


UNCONTROLLED = Uncontrolled()


@dataclass(frozen=True)
class StepEvent:
    """What on_step sees after each optimizer step (an update's, in rollout loops)."""

    global_step: int
    iteration: int  # the epoch (0-based, sft, preference) or the update (1-based)
    values: Mapping[str, float]
    tokens: int
    seconds: float


@dataclass(frozen=True)
class UpdateEvent(StepEvent):
    """What on_update sees after a rollout loop's update: the step's, and its records."""

    groups: tuple = ()  # rollout.records.Group: the update's answers, rewards, advantages


@dataclass(frozen=True)
class EvalEvent:
    """What on_evaluate sees after a scheduled evaluation."""

    global_step: int
    iteration: int
    values: Mapping[str, float]
    improved: bool


@dataclass(frozen=True)
class Hooks:
    """A caller's callbacks at the frame's one boundary. A truthy return ends the run there,
    gracefully (Result.stopped = "callback"; checkpoint and export as at any end); an
    exception fails the run as any exception does."""

    on_step: Callable[[StepEvent], object] | None = None
    on_update: Callable[[UpdateEvent], object] | None = None
    on_evaluate: Callable[[EvalEvent], object] | None = None


@dataclass(frozen=True)
class Door:
    """What the caller brings to a loop; the command line, the run server and Python differ
    only here. model/trained: a model already loaded (and a plan with its tensors already
    attached, (TrainPlan, Trained): a second fit); rewards: Python reward functions (rewards/callables.py) with their weights;
    environment/verify: a Python agent environment and verify function (agent/python_env.py)."""

    sinks: Sinks = field(default_factory=Sinks.quiet)
    control: Control = UNCONTROLLED
    hooks: Hooks = Hooks()
    resume: str | bool | None = None
    run_file: Path | None = None
    model: Any = None
    trained: Any = None
    rewards: tuple[Callable, ...] = ()
    reward_weights: tuple[float, ...] | None = None
    environment: Any = None
    verify: Callable | None = None

    @property
    def run_dir(self) -> Path:
        """Where the run file's relative paths (judge, environment, MCP) are read from."""
        return Path(self.run_file).resolve().parent if self.run_file else Path.cwd()


def door_of(door: Door | None = None, *, resume=None, sinks=None, run_file=None) -> Door:
    """The door a loop was called with, or one made of the keyword form (resume, sinks,
    run_file: what `retrograd train` and older callers pass); quiet sinks by default."""
    if door is None:
        door = Door(sinks or Sinks.quiet())
    elif sinks is not None:
        door = _replace(door, sinks=sinks)
    if resume is not None:
        door = _replace(door, resume=resume)
    if run_file is not None:
        door = _replace(door, run_file=run_file)
    return door


def _replace(door: Door, **changes) -> Door:
    return dataclasses.replace(door, **changes)


def frozen(values: Mapping[str, float]) -> Mapping[str, float]:
    """A read-only copy of a step's values, for the hooks."""
    return MappingProxyType(dict(values))
