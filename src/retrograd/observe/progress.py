"""Terminal progress: a live rich bar on a terminal, plain lines when stdout is not one.

A terminal gets a bar over the optimizer steps with loss, learning rate, tokens/s and ETA,
redrawn in place; evaluations and checkpoint saves print above it. Anything else (a log file,
a pipe, the run server reading our stdout) gets one plain line every `every_steps` steps or
every `every_seconds`, whichever comes first, plus the first and last step, so a log stays
readable and bounded. The display knows metric names only to pick the three it shows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from time import monotonic

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
from rich.progress import Progress as RichProgress
from rich.table import Table

from retrograd.observe import names
from retrograd.text import printable


def format_duration(seconds: float) -> str:
    """`1:02:03`; `-` while unknown."""
    if not math.isfinite(seconds) or seconds < 0:
        return "-"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def format_value(value: object) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, float):
        if math.isfinite(value) and abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def step_stats(values: Mapping[str, float]) -> str:
    """`reward 0.5000 · loss 1.2345 · lr 2.00e-05 · 1,234 tok/s` from the names it knows; others are left out."""
    parts = []
    if names.REWARD_MEAN in values:
        parts.append(f"reward {values[names.REWARD_MEAN]:.4f}")
    if names.DISTILL_TEACHER_KL_MEAN in values:
        parts.append(f"teacher KL {values[names.DISTILL_TEACHER_KL_MEAN]:.4f}")
    if names.TRAIN_LOSS in values:
        parts.append(f"loss {values[names.TRAIN_LOSS]:.4f}")
    if names.LEARNING_RATE in values:
        parts.append(f"lr {values[names.LEARNING_RATE]:.2e}")
    if names.TOKENS_PER_SECOND in values:
        parts.append(f"{values[names.TOKENS_PER_SECOND]:,.0f} tok/s")
    return " · ".join(parts)


class Progress:
    """Progress of one run over `total_steps` optimizer steps (global steps, resume included)."""

    def __init__(
        self,
        total_steps: int,
        *,
        console: Console | None = None,
        initial_step: int = 0,
        title: str = "training",
        every_steps: int = 10,
        every_seconds: float = 30.0,
        unit: str = "step",
    ):
        self.console = console or Console()
        self.total_steps = total_steps
        # what the bar counts: optimizer steps, or the loop's own unit ("update" for rollout
        # loops, whose updates without signal make no step); events then name it too
        self.unit = unit
        self.position = initial_step
        self.title = title
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self._initial_step = initial_step
        self._started = monotonic()
        self._last_line: tuple[int, float] | None = None  # (step, time) of the last plain line
        self._bar: RichProgress | None = None
        self._task = None

    @property
    def live(self) -> bool:
        return self.console.is_terminal

    def eta(self, global_step: int) -> float:
        """Seconds left at the pace of this run so far (evaluations and saves included)."""
        done = global_step - self._initial_step
        if done <= 0:
            return math.nan
        elapsed = monotonic() - self._started
        return elapsed / done * max(self.total_steps - global_step, 0)

    def step(self, global_step: int, epoch: int, values: Mapping[str, float]) -> None:
        """`global_step` counts in `unit`: the position of the bar."""
        self.position = global_step
        stats = step_stats(values)
        eta = format_duration(self.eta(global_step))
        if self.live:
            self._draw(global_step, stats, eta)
        elif self._line_due(global_step):
            self._last_line = (global_step, monotonic())
            elapsed = format_duration(monotonic() - self._started)
            line = f"{self.unit} {global_step}/{self.total_steps} epoch {epoch}"
            line += f" · {stats}" if stats else ""
            self.console.print(
                f"{line} · elapsed {elapsed} · eta {eta}", markup=False, highlight=False
            )

    def _line_due(self, global_step: int) -> bool:
        if self._last_line is None or global_step >= self.total_steps:
            return True
        last_step, last_time = self._last_line
        return (
            global_step - last_step >= self.every_steps
            or monotonic() - last_time >= self.every_seconds
        )

    def _draw(self, global_step: int, stats: str, eta: str) -> None:
        if self._bar is None:
            self._bar = RichProgress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TextColumn("eta {task.fields[eta]}"),
                console=self.console,
            )
            self._bar.start()
            self._task = self._bar.add_task(
                self.title, total=self.total_steps, completed=self._initial_step, stats="", eta="-"
            )
        self._bar.update(self._task, completed=global_step, stats=stats, eta=eta)

    def event(self, message: str) -> None:
        """A line that stays: above the bar on a terminal, in sequence otherwise."""
        # NOTE: markup off: paths and error messages hold brackets ("[sft].data"); control
        # characters shown, not sent (a quoted answer may hold ESC sequences).
        self.console.print(printable(message), markup=False, highlight=False)

    def evaluation(self, global_step: int, values: Mapping[str, float], improved: bool) -> None:
        shown = ", ".join(f"{name} {format_value(float(v))}" for name, v in values.items())
        best = " (best)" if improved else ""
        self.event(f"eval at {self._at(global_step)}: {shown or 'no values'}{best}")

    def checkpoint(self, path: str | Path, global_step: int) -> None:
        self.event(f"checkpoint at {self._at(global_step)}: {path}")

    def _at(self, global_step: int) -> str:
        if self.unit == "step":
            return f"step {global_step}"
        return f"{self.unit} {self.position} (step {global_step})"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def summary(self, rows: Mapping[str, object], *, title: str = "run summary") -> None:
        self.close()
        table = Table(title=title, show_header=False, title_justify="left")
        table.add_column(style="bold")
        table.add_column()
        for label, value in rows.items():
            table.add_row(escape(printable(label)), escape(printable(format_value(value))))
        self.console.print(table)

    def fail(self, message: str) -> None:
        self.close()
        self.console.print(
            f"[bold red]run failed:[/] {escape(printable(message))}", highlight=False
        )
