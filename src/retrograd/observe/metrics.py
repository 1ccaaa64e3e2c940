"""The one object a training loop reports to: terminal progress plus the configured sinks.

A loop calls `step` once per optimizer step, `evaluation` after each evaluation, `checkpoint`
after each save and `finish` at the end; used as a context manager, an exception records
`run_failed` in every sink before it propagates. Sinks see finite values only (formats.md §7.1:
non-finite omitted); the terminal shows what it is given, so a NaN loss is visible there.
This module knows nothing about models or algorithms: the loop names its values (`names`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from time import monotonic
from typing import Protocol

from rich.console import Console

from retrograd.observe import memory, names
from retrograd.observe.progress import Progress, format_duration
from retrograd.observe.run_info import RunInfo
from retrograd.observe.tensorboard import TensorBoardSink
from retrograd.observe.wandb_export import PROJECT, WandbExport


class Sink(Protocol):
    def step(self, global_step: int, epoch: int, values: Mapping[str, float]) -> None: ...
    def finish(self, global_step: int) -> None: ...
    def fail(self, message: str) -> None: ...


def floats(values: Mapping[str, float]) -> dict[str, float]:
    """Values as plain floats: loops may hand in 0-d tensors or numpy scalars."""
    return {name: float(value) for name, value in values.items()}


def finite(values: Mapping[str, float]) -> dict[str, float]:
    return {name: value for name, value in values.items() if math.isfinite(value)}


class Metrics:
    """Reports one run. Create it when the first step is about to start: its clock starts here."""

    def __init__(
        self,
        run_info: RunInfo,
        *,
        total_steps: int,
        tensorboard_dir: str | Path | None = None,
        wandb_export_dir: str | Path | None = None,
        console: Console | None = None,
        initial_step: int = 0,
        wandb_project: str = PROJECT,
        every_steps: int = 10,
        every_seconds: float = 30.0,
        unit: str = "step",
        initial_position: int | None = None,
    ):
        """`unit` is what the progress bar counts over `total_steps`: optimizer steps, or
        "update" for rollout loops (`initial_position` their first, on resume)."""
        self.run_info = run_info
        # W&B first: a missing wandb package fails before any directory is created.
        self.wandb = None
        if wandb_export_dir is not None:
            self.wandb = WandbExport(wandb_export_dir, run_info, project=wandb_project)
        self.tensorboard = None
        if tensorboard_dir is not None:
            self.tensorboard = TensorBoardSink(tensorboard_dir)
        self.sinks: list[Sink] = [s for s in (self.tensorboard, self.wandb) if s is not None]
        self.progress = Progress(
            total_steps,
            console=console,
            initial_step=initial_step if initial_position is None else initial_position,
            title=run_info.algorithm,
            every_steps=every_steps,
            every_seconds=every_seconds,
            unit=unit,
        )
        self.global_step = initial_step
        self.epoch = 0
        self.best_eval: dict[str, float] = {}
        self.closed = False
        self._started = monotonic()
        self._clock = self._started  # end of the last step, evaluation or save
        self._tokens = 0
        self._train_seconds = 0.0

    def step(
        self,
        global_step: int,
        epoch: int,
        values: Mapping[str, float],
        tokens: int = 0,
        position: int | None = None,
    ) -> None:
        """One optimizer step (or a rollout loop's update: `position` in the progress unit).
        `tokens` trained since the previous step give tokens/s, unless `values` already holds
        `system/tokens_per_second`."""
        assert not self.closed, "step() after finish() or fail()"
        now = monotonic()
        seconds, self._clock = now - self._clock, now
        self._tokens += tokens
        self._train_seconds += seconds
        shown = floats(values)
        if tokens and seconds > 0 and names.TOKENS_PER_SECOND not in shown:
            shown[names.TOKENS_PER_SECOND] = tokens / seconds
        self.global_step, self.epoch = global_step, epoch
        self._emit(global_step, epoch, shown)
        self.progress.step(global_step if position is None else position, epoch, shown)

    def evaluation(
        self, global_step: int, values: Mapping[str, float], *, improved: bool | None = None
    ) -> None:
        """Evaluation results, logged at the step they ran after. `improved=None` decides by
        lowest `eval/loss` (SFT, preference); rollout loops pass their own verdict."""
        assert not self.closed, "evaluation() after finish() or fail()"
        values = floats(values)
        kept = finite(values)
        if improved is None:
            loss = kept.get(names.EVAL_LOSS)
            best = self.best_eval.get(names.EVAL_LOSS, math.inf)
            improved = loss is not None and loss < best
        if improved:
            self.best_eval = kept
        self._emit(global_step, self.epoch, values)
        self.progress.evaluation(global_step, values, improved)
        self._clock = monotonic()  # evaluation time is not training time

    def checkpoint(self, path: str | Path, global_step: int | None = None) -> None:
        self.progress.checkpoint(path, self.global_step if global_step is None else global_step)
        self._clock = monotonic()

    def _emit(self, global_step: int, epoch: int, values: Mapping[str, float]) -> None:
        kept = finite(values)
        for sink in self.sinks:
            sink.step(global_step, epoch, kept)

    def outputs(self) -> dict[str, str]:
        """Where the sinks wrote, for the summary."""
        rows = {}
        if self.tensorboard is not None:
            rows["tensorboard"] = str(self.tensorboard.run_dir)
        if self.wandb is not None:
            rows["wandb (offline run)"] = str(self.wandb.run_dir)
        return rows

    def summary_rows(self, summary: Mapping[str, object] | None = None) -> dict[str, object]:
        """Our own rows (outputs, best evaluation, time, tokens/s, peak memory), then the
        caller's, which add to or replace them."""
        progress = self.progress
        if progress.unit == "step":
            rows: dict[str, object] = {"steps": f"{self.global_step}/{progress.total_steps}"}
        else:
            rows = {f"{progress.unit}s": f"{progress.position}/{progress.total_steps}"}
            rows["optimizer steps"] = self.global_step
        rows.update(self.outputs())
        rows.update({f"best {name}": value for name, value in self.best_eval.items()})
        rows["time"] = format_duration(monotonic() - self._started)
        if self._tokens and self._train_seconds > 0:
            rows["tokens/s"] = round(self._tokens / self._train_seconds, 1)
        rows["peak memory"] = memory.describe(memory.peak_memory())
        rows.update(summary or {})
        return rows

    def finish(self, summary: Mapping[str, object] | None = None) -> None:
        """Close every sink (`run_finished`) and print the summary table. Once only."""
        if self.closed:
            return
        self.closed = True
        for sink in self.sinks:
            sink.finish(self.global_step)
        self.progress.summary(self.summary_rows(summary))

    def fail(self, message: str) -> None:
        """Record `run_failed` in every sink and say so on the terminal. Once only."""
        if self.closed:
            return
        self.closed = True
        for sink in self.sinks:
            sink.fail(message)
        self.progress.fail(message)

    def __enter__(self) -> Metrics:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            self.finish()
        elif isinstance(exc, KeyboardInterrupt):
            self.fail("interrupted")
        else:
            self.fail(f"{exc_type.__name__}: {exc}")
        return False
