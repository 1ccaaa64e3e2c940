"""The frame every training loop runs in: what the caller brings, the opened run, the boundary
after each step or update, and the finish.

A loop opens its run (`open_run`: model, trained tensors, identity, patience, the position a
checkpoint restores, sinks), makes its own steps, hands each step's report to `after_step`
(which reports, obeys a served run's commands, calls the caller's hooks, evaluates, keeps the
best, checkpoints and says whether to stop), and ends with `finish` (export, summary).

The frame knows the shared sections ([training], [lora], [evaluation], [checkpoint],
[metrics], [observe], [output]) and nothing of any algorithm's section or math. The doors
(cli/train.py, server/child.py, the Python API) differ only in the `Door` they pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

from retrograd.observe.run_info import RunInfo
from retrograd.observe.sinks import Sinks, StartInfo

# -- the door: what the caller brings ---------------------------------------------------------


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
    only here. model/trained: a model already loaded (and adapters already attached, a
    second fit); rewards: Python reward functions (rewards/callables.py) with their weights;
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


def prepare(cfg, door: Door | None = None, *, resume=None, sinks=None, run_file=None) -> Door:
    """A loop's first call: its door (door_of), and the outputs checked before anything loads
    (checkpoint/outputs.py: rank 0 probes the folders)."""
    from retrograd.checkpoint import outputs

    door = door_of(door, resume=resume, sinks=sinks, run_file=run_file)
    outputs.check_outputs(cfg, door.run_file)
    return door


def start_info(
    cfg,
    model,
    plan,
    total_steps: int,
    *,
    data: tuple[Path, str],
    held: tuple[Path, str] | None,
    iterations: int,
    initial_step: int = 0,
    unit: str = "step",
    initial_position: int | None = None,
) -> StartInfo:
    """What the sinks print and record at the start. data, held: (path, one-line
    description) of the training and evaluation files; iterations: epochs or updates."""
    lines = [
        f"model: {model.gguf.path.name} ({model.config.name}); {model.report.describe()}",
        *model.report.lines(),  # the compute plan
        f"data: {data[1]}",
        *([f"evaluation: {held[1]}"] if held is not None else []),
        *plan.describe(),
    ]
    t, m = cfg.training, cfg.metrics
    info = RunInfo(
        cfg.run.algorithm,
        str(cfg.model.path),
        str(data[0]),
        str(held[0]) if held else None,
        iterations,
        t.lr,
        t.lr_scheduler,
        t.warmup_steps,
    )
    return StartInfo(
        tuple(lines),
        info,
        total_steps,
        iterations,
        initial_step,
        unit,
        initial_position,
        m.tensorboard_dir if m else None,
        m.wandb_export_dir if m else None,
        model.report.describe(),
        str(model.dtype),
    )


def _replace(door: Door, **changes) -> Door:
    import dataclasses

    return dataclasses.replace(door, **changes)


def frozen(values: Mapping[str, float]) -> Mapping[str, float]:
    """A read-only copy of a step's values, for the hooks."""
    return MappingProxyType(dict(values))
