"""A run's metric sinks: terminal progress always, TensorBoard and W&B when configured.

The frame (algorithms/frame.py) reports to one `Sinks` at fixed points: the start (its lines
and the run's description, a `StartInfo`), each step or update, evaluations, checkpoints
written, the summary, a failure. Doors subclass it to send the same reports elsewhere (the
run server's channel, a benchmark's clock). It knows no model, no config and no loop: what
it prints arrives as text; a served run's commands are the frame's `Control`, not a sink.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from retrograd.observe.metrics import Metrics
from retrograd.observe.run_info import RunInfo

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StartInfo:
    """What the run is about to do: the lines to print (model, compute plan, data, trained
    tensors), its description (run.json, W&B), where its metrics go, and how its progress
    counts: total_steps of `unit` (optimizer steps, or the loop's updates) over `iterations`
    epochs or updates, from initial_step (initial_position in `unit`) on resume; and, for a
    benchmark's sinks, what the model computes with."""

    lines: tuple[str, ...]
    info: RunInfo
    total_steps: int
    iterations: int
    initial_step: int = 0
    unit: str = "step"
    initial_position: int | None = None
    tensorboard_dir: str | Path | None = None
    wandb_export_dir: str | Path | None = None
    backend: str = ""  # what loading decided: device, dtype, cache (model.report.describe())
    dtype: str = ""  # the dtype the model computes in ("torch.bfloat16")


class Sinks:
    """The run's metrics: terminal progress always, TensorBoard and W&B when configured."""

    def __init__(self, quiet: bool = False, console: Console | None = None):
        self.quiet = quiet
        self.console = console
        self.metrics: Metrics | None = None

    @classmethod
    def quiet(cls) -> Sinks:
        return cls(quiet=True)

    def start(self, start: StartInfo) -> None:
        """Print what the run is about to do and open the metric sinks."""
        if self.quiet:
            return
        for line in start.lines:
            self.console.print(line, markup=False)  # "[lora].targets" is text, not markup
        self.metrics = Metrics(
            start.info,
            total_steps=start.total_steps,
            console=self.console,
            tensorboard_dir=start.tensorboard_dir,
            wandb_export_dir=start.wandb_export_dir,
            initial_step=start.initial_step,
            unit=start.unit,
            initial_position=start.initial_position,
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
        """One optimizer step's metrics (or an update's), by their names (observe/names.py);
        `position` in the progress unit when it is not the step."""
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
