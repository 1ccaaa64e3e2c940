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
from retrograd.observe import Metrics, RunInfo
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


class Sinks:
    """The run's metrics: terminal progress always, TensorBoard and W&B when configured."""

    def __init__(self, quiet: bool = False, console=None):
        self.quiet = quiet
        self.console = console
        self.metrics: Metrics | None = None

    @classmethod
    def quiet(cls) -> Sinks:
        return cls(quiet=True)

    def start(
        self,
        cfg,
        model,
        plan,
        total_steps: int,
        *,
        data: tuple[Path, str],
        held: tuple[Path, str] | None = None,
        iterations: int,
        initial_step: int = 0,
        unit: str = "step",
        initial_position: int | None = None,
    ) -> None:
        """Print what the run is about to do and open the metric sinks. data, held: (path,
        one-line description) of the training and evaluation files; iterations: epochs or
        updates; total_steps counts `unit` (optimizer steps, or the loop's updates, from
        `initial_position` on resume)."""
        self.plan_lines = plan.describe()
        if self.quiet:
            return
        con = self.console
        con.print(f"model: {model.gguf.path.name} ({model.config.name}); {model.report.describe()}")
        for line in model.report.lines():  # the compute plan
            con.print(line, markup=False)
        con.print(f"data: {data[1]}", markup=False)
        if held is not None:
            con.print(f"evaluation: {held[1]}", markup=False)
        for line in self.plan_lines:
            con.print(line, markup=False)  # "[lora].targets" is text, not rich markup
        m = cfg.metrics
        info = RunInfo(
            cfg.run.algorithm,
            str(cfg.model.path),
            str(data[0]),
            str(held[0]) if held else None,
            iterations,
            cfg.training.lr,
            cfg.training.lr_scheduler,
            cfg.training.warmup_steps,
        )
        self.metrics = Metrics(
            info,
            total_steps=total_steps,
            console=con,
            tensorboard_dir=m.tensorboard_dir if m else None,
            wandb_export_dir=m.wandb_export_dir if m else None,
            initial_step=initial_step,
            unit=unit,
            initial_position=initial_position,
        )

    def resumed(self, source: str, global_step: int) -> None:
        if self.metrics is not None:
            self.console.print(f"resumed from {source} at step {global_step}")
            self.metrics.global_step = global_step

    def step(
        self,
        global_step: int,
        epoch: int,
        values: dict[str, float],
        tokens: int,
        seconds: float,
        position: int | None = None,
    ) -> None:
        """One optimizer step's metrics, by their names (observe/names.py); `position` in
        the progress unit when it is not the step."""
        if self.metrics is not None:
            self.metrics.step(global_step, epoch, values, tokens=tokens, position=position)

    def note(self, message: str) -> None:
        """A line on the terminal (and the log) about a long phase outside the steps."""
        _log.info("%s", message)
        if self.metrics is not None:
            self.console.print(message, markup=False, highlight=False)

    def warn(self, message: str) -> None:
        """A warning the run goes on after: on stderr's log, and on the terminal."""
        _log.warning("%s", message)
        if self.metrics is not None:
            self.console.print(f"warning: {message}", markup=False, style="yellow")

    def evaluation(self, global_step: int, values: dict[str, float], improved: bool) -> None:
        if self.metrics is not None:
            self.metrics.evaluation(global_step, values, improved=improved)

    def checkpoint(self, path: Path, global_step: int) -> None:
        if self.metrics is not None:
            self.metrics.checkpoint(path, global_step)

    def finish(self, summary: dict[str, object]) -> None:
        """The end-of-run summary lines, {label: value}."""
        if self.metrics is not None:
            self.metrics.finish(summary)

    def fail(self, message: str) -> None:
        if self.metrics is not None:
            self.metrics.fail(message)

    def checkpoint_requested(self) -> bool:
        """Whether a checkpoint is wanted at this boundary though none is due (the run
        server's sinks say so when a client asks for one)."""
        return False

    def checkpoint_section(self, cfg):
        """The [checkpoint] the run follows now: the file's, or what a client changed it to
        during the run (the run server's sinks)."""
        return cfg.checkpoint

    def boundary(self, cfg, measure: Callable[[], dict | None]):
        """The loop's boundary, after an update's (or a step's) report: the run server's
        sinks act there on what a client asked meanwhile (pause, checkpoint, stop, questions
        answered with the weights as they are; `measure()` is the loop's own evaluation
        without patience, {field: value}, or None without evaluation data). -> the config the
        run follows from here on: `cfg`, or `cfg` with the keys a client changed."""
        return cfg


def boundary(sinks: Sinks, cfg, patience, measure: Callable[[], dict | None]):
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
