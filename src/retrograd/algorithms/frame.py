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

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from retrograd.algorithms import context
from retrograd.algorithms.door import (
    Door,
    EvalEvent,
    StepEvent,
    UpdateEvent,
    door_of,
    frozen,
)
from retrograd.algorithms.evaluate import Evaluation, Patience
from retrograd.checkpoint import DatasetPosition, Progress, step_id
from retrograd.checkpoint import run as checkpoints
from retrograd.checkpoint.export import export_or_keep
from retrograd.observe import names
from retrograd.observe.run_info import RunInfo
from retrograd.observe.sinks import Sinks, StartInfo

log = logging.getLogger(__name__)


# -- opening ----------------------------------------------------------------------------------


def prepare(cfg, door: Door | None = None, *, resume=None, sinks=None, run_file=None) -> Door:
    """A loop's first call: its door (door_of), and the outputs checked before anything loads
    (checkpoint/outputs.py: rank 0 probes the folders)."""
    from retrograd.checkpoint import outputs

    door = door_of(door, resume=resume, sinks=sinks, run_file=run_file)
    outputs.check_outputs(cfg, door.run_file)
    return door


def start_info(cfg, model, plan, inputs: Inputs, shape: Shape, pos: Position) -> StartInfo:
    """What the sinks print and record at the start: the model and its compute plan, the data,
    the trained tensors; a rollout loop's bar counts updates, the others' optimizer steps."""
    held = inputs.held
    lines = [
        f"model: {model.gguf.path.name} ({model.config.name}); {model.report.describe()}",
        *model.report.lines(),  # the compute plan
        f"data: {inputs.data[1]}",
        *([f"evaluation: {held[1]}"] if held is not None else []),
        *plan.describe(),
    ]
    t, m, rollouts = cfg.training, cfg.metrics, shape.unit == "update"
    info = RunInfo(
        cfg.run.algorithm,
        str(cfg.model.path),
        str(inputs.data[0]),
        str(held[0]) if held else None,
        shape.iterations,
        t.lr,
        t.lr_scheduler,
        t.warmup_steps,
    )
    return StartInfo(
        tuple(lines),
        info,
        shape.iterations if rollouts else shape.total_steps,
        shape.iterations,
        pos.global_step,
        shape.unit,
        pos.update if rollouts else None,
        m.tensorboard_dir if m else None,
        m.wandb_export_dir if m else None,
        model.report.describe(),
        str(model.dtype),
    )


# -- the records ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Position:
    """Where a loop stands between two steps (or updates); resume continues from exactly here.
    A checkpoint keeps it as its progress and its dataset position, field for field."""

    global_step: int = 0
    epoch: int = 0  # completed epochs (sft, preference); 0 in rollout loops
    update: int = 0  # completed updates (rollout loops); 0 in sft, preference
    index: int = 0  # next example or pair of the epoch's order, or prompts or scenarios drawn
    at: Mapping[str, Any] = field(default_factory=dict)  # the dataset position's extra
    extra: Mapping[str, Any] = field(default_factory=dict)  # the loop's own counters

    @classmethod
    def from_state(cls, state) -> Position:
        p, ds = state.progress, state.dataset
        return cls(p.global_step, p.epoch, p.update, ds.index, dict(ds.extra), dict(p.extra))

    def dataset(self) -> DatasetPosition:
        return DatasetPosition(self.epoch, self.index, dict(self.at))

    def progress(self, patience: Patience) -> Progress:
        best = patience.best if patience.best != float("inf") else None
        return Progress(
            self.global_step, self.epoch, self.update, best, patience.stale, dict(self.extra)
        )

    def after_update(self, update: int, cursor: int, global_step: int, **extra) -> Position:
        """A rollout loop's position after `update`, with `cursor` prompts drawn."""
        return Position(global_step, 0, update, cursor, {"update": update}, extra)


@dataclass
class Result:
    """What every loop returns."""

    output: Path
    global_step: int = 0
    iterations: int = 0  # epochs (sft, preference) or updates completed
    stopped: str | None = None  # why the run ended before its last step: "patience", ...
    seconds: float = 0.0
    tokens: int = 0
    curve: list[float] = field(default_factory=list)  # the tracked metric of each step/update
    evals: list[tuple[int, dict[str, float]]] = field(default_factory=list)  # (step or update,
    best_eval: float | None = None  # eval/* values) of each scheduled evaluation
    counts: dict[str, int] = field(default_factory=dict)  # agent: skipped, no_signal updates
    warnings: list[str] = field(default_factory=list)  # preference: logps_drop_warn
    last_loss: float | None = None

    def summary(self) -> dict[str, object]:
        """The run's figures as plain values."""
        return {
            "output": str(self.output),
            "global_step": self.global_step,
            "iterations": self.iterations,
            "stopped": self.stopped,
            "seconds": self.seconds,
            "tokens": self.tokens,
            "best_eval": self.best_eval,
            "last_loss": self.last_loss,
            **self.counts,
        }


@dataclass(frozen=True)
class Inputs:
    """What a loop read before its model loaded: the files' fingerprints (resume checks them),
    its section's settings that change a step, and (path, one line) of its data for the start."""

    fingerprints: dict[str, str | None]
    settings: dict
    data: tuple[Path, str]
    held: tuple[Path, str] | None = None


@dataclass(frozen=True)
class Shape:
    """How a loop counts: optimizer steps for the schedule, epochs or updates for the bar; the
    metric each step or update adds to Result.curve, and its summary line's label."""

    total_steps: int
    iterations: int
    unit: Literal["step", "update"]
    tracked: str | None = None
    tracked_label: str = ""
    tracked_empty: str = "no update ran"


@dataclass(frozen=True)
class Report:
    """What a loop hands `after_step`: the step's (or update's) values, tokens, when it began,
    the sinks' epoch and the global step before it; whether it ends an epoch (sft,
    preference: evaluation and patience wait for it), whether it trained ([observe]), the
    update's records (rollout loops), and the checkpoint artifacts (callables of bytes)."""

    values: dict[str, float]
    tokens: int
    began: float  # time.perf_counter() at the step's start
    epoch: int
    before: int
    iteration_done: bool = True
    trained: bool = True
    groups: list | None = None
    artifacts: Mapping[str, Callable[[], bytes]] = field(default_factory=dict)


@dataclass
class Live:
    """What a boundary may change (a served run's patched keys, the base rate) and the record
    so far."""

    cfg: Any
    rate: float
    patience: Patience
    result: Result
    stop: str | None = None  # a hook asked to stop


@dataclass(frozen=True)
class Run:
    """An opened run: everything a loop's steps and the frame's boundary read."""

    model: Any
    tr: context.Trainables
    identity: checkpoints.RunIdentity
    door: Door
    shape: Shape
    world: Any  # distributed.World
    replicas: Any  # distributed.Replicas: sum_step of the trained gradients; .sharded
    restored: Any  # CheckpointState or None
    source: str | None
    position: Position
    evaluation: Evaluation | None
    observe: Any  # observe.rollouts.ObserveWriter or None
    live: Live
    closing: ExitStack
    started: float

    @property
    def cfg(self):
        return self.live.cfg

    @property
    def result(self) -> Result:
        return self.live.result

    @property
    def sinks(self) -> Sinks:
        return self.door.sinks


def model_of(cfg, door: Door):
    """The door's model (a caller's, loaded once), else the run's own, loaded now."""
    return door.model if door.model is not None else context.load_model(cfg)


def open_run(
    cfg,
    model,
    door: Door,
    inputs: Inputs,
    shape: Shape,
    *,
    evaluation: Evaluation | None = None,
    observe: str | None = None,
) -> Run:
    """The run opened over its loaded model: the preflight audit, memory knobs, the trained
    tensors and their optimizer (the door's, a second fit), the ranks' handle on them, the
    identity a checkpoint must match, patience, the restored position, the sinks started, the
    [observe] writer (rollout loops: `observe` names the algorithm), the control told."""
    from retrograd import distributed

    started = time.perf_counter()
    t = cfg.training
    console = getattr(door.sinks, "console", None)
    context.preflight_check(model, t, console)
    context.apply_memory_knobs(model, t)
    tr = context.trainables(model, cfg, door.trained)
    # under torchrun each rank trains its share of every step (docs/distributed.md)
    replicas = distributed.wrap_trainable(model, tr)
    identity = checkpoints.RunIdentity.of(
        cfg, model.config.name, inputs.fingerprints, tr.plan, inputs.settings
    )
    patience = Patience.of(cfg.evaluation)
    state, source = _restored(cfg, door, identity, tr, patience)
    pos = Position.from_state(state) if state is not None else Position()
    door.sinks.start(start_info(cfg, model, tr.plan, inputs, shape, pos))
    if source is not None:
        door.sinks.resumed(source, pos.global_step)
    closing = ExitStack()
    writer = _observe(cfg, observe, inputs.settings, pos, source, console) if observe else None
    if writer is not None:
        closing.callback(writer.close)
    result = Result(Path(cfg.output.path), pos.global_step, pos.update or pos.epoch)
    live = Live(cfg, tr.rate, patience, result)
    run = Run(
        model, tr, identity, door, shape, distributed.world(), replicas, state, source, pos,
        evaluation, writer, live, closing, started,
    )  # fmt: skip
    door.control.opened(run)
    return run


def _restored(cfg, door: Door, identity, tr, patience: Patience):
    """(the checkpoint's state, where it came from) with the trained tensors, optimizer, RNGs
    and patience put back; (None, None) for a fresh run."""
    found = checkpoints.find_resume(cfg, door.resume)
    if found is None:
        return None, None
    state = checkpoints.restore(found, identity, tr.named, tr.optimizer)
    if state.progress.best_metric is not None:
        patience.best = state.progress.best_metric
    patience.stale = state.progress.stale_evaluations
    return state, found[1]


def _observe(cfg, algorithm: str, settings: dict, pos: Position, source, console):
    """The [observe] writer (None without the section, and on every rank but rank 0), told
    the update a resumed run continues after."""
    from retrograd import distributed
    from retrograd.observe.rollouts import ObserveWriter

    if not distributed.world().main:
        return None
    resumed = pos.update if source is not None else None
    return ObserveWriter.open(
        cfg.observe,
        algorithm=algorithm,
        model=cfg.model.path,
        params=settings,
        resumed_from_update=resumed,
        console=console,
    )


def evaluate_with(run: Run, evaluation: Evaluation) -> Run:
    """The run with its held-out measure: loops build it after open_run, as it closes over
    what needs the trained tensors (a backend, a reference)."""
    return dataclasses.replace(run, evaluation=evaluation)


# -- the steps --------------------------------------------------------------------------------


def lr(run: Run, step: int) -> float:
    """The learning rate of optimizer step `step` (counted from 0) by the run's schedule."""
    from retrograd.optim import lr_at

    t = run.live.cfg.training
    return lr_at(step, run.shape.total_steps, run.live.rate, t.lr_scheduler, t.warmup_steps)


def optimizer_step(run: Run, step: int, loss: float, where: str) -> tuple[float, float]:
    """The checked optimizer step at `step`'s rate (step.checked_step) -> (rate, gradient
    norm). The gradients are summed over the ranks before: by the loop, whose sums differ."""
    from retrograd.algorithms.step import checked_step

    rate = lr(run, step)
    norm = checked_step(
        run.tr.params, run.tr.optimizer, run.live.cfg.training.max_grad_norm, rate, loss, where
    )
    return rate, norm


def observe_rollouts(run: Run, update: int, groups, selection: bool = False) -> None:
    """The update's records to [observe], before training (their outcome follows)."""
    if run.observe is not None:
        run.observe.rollouts(update, groups)
        if selection:
            run.observe.selection(update, groups)


def after_step(run: Run, pos: Position, report: Report) -> str | None:
    """Everything between two steps (or updates): [observe]'s outcome, the sinks' step, the
    control's boundary (a served run's commands and patched keys), the result's record, the
    hooks, the scheduled evaluation and its `best` checkpoint, the `steps` checkpoint. ->
    why the run stops here ("patience", "callback"), or None."""
    live, door, shape = run.live, run.door, run.shape
    rollouts = shape.unit == "update"
    values = report.values
    if run.observe is not None and report.groups is not None:
        run.observe.outcome(pos.update, report.groups)
        values[names.OBSERVE_DROPPED] = run.observe.dropped_batches
        run.observe.update(pos.update, "completed" if report.trained else "skipped", values)
    seconds = time.perf_counter() - report.began
    position = pos.update if rollouts else None
    door.sinks.step(pos.global_step, report.epoch, values, report.tokens, seconds, position)
    _boundary(run)
    result = live.result
    result.global_step, result.tokens = pos.global_step, result.tokens + report.tokens
    if shape.tracked is not None and shape.tracked in values:
        result.curve.append(values[shape.tracked])
    if names.TRAIN_LOSS in values:
        result.last_loss = values[names.TRAIN_LOSS]
    log.debug("%s: %s", _where(run, pos), {k: round(v, 4) for k, v in values.items()})
    iteration = pos.update if rollouts else report.epoch + 1
    _hooks(run, pos, report, iteration, seconds)
    done = pos.update if rollouts else pos.epoch
    if report.iteration_done and evaluation_due(live.cfg, done, shape.iterations):
        _evaluate(run, pos, report, done)
    section = door.control.checkpoint_section(live.cfg)
    requested = section is not None and door.control.checkpoint_requested()
    if requested or checkpoints.checkpoint_due(section, report.before, pos.global_step):
        _save(run, pos, report.artifacts, section, step_id(pos.global_step))
    if report.iteration_done and live.patience.stop:
        result.stopped = "patience"
    elif live.stop is not None:
        result.stopped = live.stop
    return result.stopped


def _boundary(run: Run) -> None:
    """The control's boundary: the config from here on; a changed [evaluation].patience is
    the limit from now on, a changed [training].lr the base the schedule scales (a warm-up
    keeps warming toward it, a decay keeps decaying from it)."""
    from retrograd.optim import base_lr

    live, evaluation = run.live, run.evaluation
    cfg = live.cfg
    measure = evaluation.measure if evaluation is not None else None
    live.cfg = run.door.control.boundary(cfg, lambda: measure(cfg) if measure else None)
    if live.cfg.evaluation is not None:
        live.patience.patience = live.cfg.evaluation.patience
    live.rate = base_lr(live.cfg.training, live.cfg.optimizer)


def _hooks(run: Run, pos: Position, report: Report, iteration: int, seconds: float) -> None:
    hooks = run.door.hooks
    values = frozen(report.values)
    step = StepEvent(pos.global_step, iteration, values, report.tokens, seconds)
    if hooks.on_step is not None and hooks.on_step(step):
        run.live.stop = "callback"
    if hooks.on_update is not None and report.groups is not None:
        update = UpdateEvent(**vars(step), groups=tuple(report.groups))
        if hooks.on_update(update):
            run.live.stop = "callback"


def _evaluate(run: Run, pos: Position, report: Report, done: int) -> None:
    """The scheduled evaluation: patience, the result, the sinks, the hook, and the `best`
    checkpoint when it improved."""
    evaluation, live = run.evaluation, run.live
    if evaluation is None or evaluation.run is None:
        return
    t0 = time.perf_counter()
    values = evaluation.run(live.cfg)
    metric = values[evaluation.metric]
    improved = live.patience.update(-metric if evaluation.higher_is_better else metric)
    rollouts = run.shape.unit == "update"
    live.result.evals.append((pos.update if rollouts else pos.global_step, values))
    log.info(
        "evaluation at %s: %s %.4f in %.2f s",
        _where(run, pos),
        evaluation.metric,
        metric,
        time.perf_counter() - t0,
    )
    run.door.sinks.evaluation(pos.global_step, values, improved)
    hook = run.door.hooks.on_evaluate
    if hook is not None and hook(EvalEvent(pos.global_step, done, frozen(values), improved)):
        live.stop = "callback"
    section = run.door.control.checkpoint_section(live.cfg)
    if improved and checkpoints.keeps_best(section):
        _save(run, pos, report.artifacts, section, "best")


def _save(run: Run, pos: Position, artifacts, section, checkpoint_id: str) -> None:
    tr = run.tr
    state = _state(run, pos, artifacts)
    path = checkpoints.save(section.directory, checkpoint_id, state, tr.named, tr.optimizer)
    run.door.sinks.checkpoint(path, pos.global_step)
    run.door.control.checkpoint_written(path, pos.global_step)


def _state(run: Run, pos: Position, artifacts):
    tr = run.tr
    return checkpoints.state_of(
        run.live.cfg,
        run.identity,
        pos.progress(run.live.patience),
        pos.dataset(),
        tr.named,
        tr.optimizer,
        tr.plan,
        run.shape.total_steps,
        {name: make() for name, make in (artifacts or {}).items()},
    )


def _where(run: Run, pos: Position) -> str:
    if run.shape.unit == "update":
        return f"update {pos.update}"
    return f"step {pos.global_step}"


def evaluation_due(cfg, done: int, total: int) -> bool:
    """Whether [evaluation] runs after `done` completed epochs or updates: every
    every_iterations of them, and after the last one."""
    if cfg.evaluation is None:
        return False
    return done % cfg.evaluation.every_iterations == 0 or done == total


# -- the end ----------------------------------------------------------------------------------


def finish(
    run: Run,
    pos: Position,
    *,
    artifacts: Mapping[str, Callable[[], bytes]] | None = None,
    summary: Mapping[str, object] | None = None,
) -> Result:
    """What the loop holds closed; the result exported (kept elsewhere if that fails, and the
    error says where: a checkpoint of `pos` with `artifacts`); the result filled; the
    summary printed: the output, the epochs, the tracked metric's first -> last, the loop's
    own `summary` lines, and whether it stopped early."""
    run.closing.close()
    cfg, tr, live = run.live.cfg, run.tr, run.live
    state = lambda: _state(run, pos, artifacts)  # noqa: E731
    export_or_keep(cfg, run.model, tr.plan, tr.trained, run.door.run_file, state, pos.global_step)
    result, shape = live.result, run.shape
    result.global_step = pos.global_step
    result.iterations = pos.update if shape.unit == "update" else pos.epoch
    best = live.patience.best
    if best != float("inf"):
        higher = run.evaluation is not None and run.evaluation.higher_is_better
        result.best_eval = -best if higher else best
    result.seconds = time.perf_counter() - run.started
    lines: dict[str, object] = {cfg.output.kind or "adapter": str(result.output)}
    if shape.unit == "step":
        lines["epochs"] = result.iterations
    if shape.tracked_label:
        lines[shape.tracked_label] = first_last(result.curve, shape.tracked_empty)
    lines.update(summary or {})
    lines["stopped early"] = f"yes ({result.stopped})" if result.stopped else "no"
    run.door.sinks.finish(lines)
    return result


def first_last(values: list[float], empty: str = "no update ran") -> str:
    """A summary's "first -> last" of a metric's values."""
    return f"{values[0]:.4f} -> {values[-1]:.4f}" if values else empty
