"""[training].max_gpu_duty_cycle: an upper bound on the share of wall time spent in GPU work.

The limiter counts all the time between two optimizer steps as compute (generation, scoring,
the backward passes and the step itself; reward programs too, so the GPU's real share is at
most the setting, never more) and after each step idles `busy * (1 / fraction - 1)`: at 0.5, a
200 ms window earns 200 ms of rest. It frees compute, not memory, and is a maximum, not a
target. On the CPU, or at 1.0, it is inactive and says why (formats.md §8.3). One limiter per
process, set when a run starts (`configure`) and ticked by the shared optimizer step
(step.py), so every loop honours it without a line of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class DutyCycle:
    requested: float = 1.0
    active: bool = False
    reason: str = "no_limit"  # why inactive: no_limit (1.0) or cpu_backend
    compute_s: float = 0.0
    idle_s: float = 0.0
    clock: Callable[[], float] = time.perf_counter
    sleep: Callable[[float], None] = time.sleep
    synchronize: Callable[[], None] = lambda: None
    _since: float | None = field(default=None, repr=False)

    def start(self) -> None:
        """The accounted window opens now (the loop's work before its first step counts)."""
        self._since = self.clock()

    def tick(self) -> None:
        """After an optimizer step: idle long enough to keep compute / wall <= requested."""
        if not self.active:
            return
        self.synchronize()  # the step's GPU work is done, not just queued
        now = self.clock()
        busy = now - (self._since if self._since is not None else now)
        self.compute_s += busy
        rest = busy * (1.0 / self.requested - 1.0)
        if rest > 0:
            self.sleep(rest)
            self.idle_s += rest
        self._since = self.clock()

    def report(self) -> list[str]:
        """The backend report's lines (formats.md §8.3)."""
        lines = [
            f"gpu_duty_cycle_requested: {self.requested:g}",
            f"gpu_duty_cycle_active: {str(self.active).lower()}",
        ]
        if not self.active:
            lines.append(f"gpu_duty_cycle_reason: {self.reason}")
        return lines

    @property
    def observed(self) -> float:
        """compute / accounted time (about the setting once steps have run)."""
        total = self.compute_s + self.idle_s
        return self.compute_s / total if total else 0.0


_CURRENT = DutyCycle()


def configure(fraction: float, device: torch.device) -> DutyCycle:
    """The run's limiter for [training].max_gpu_duty_cycle on `device`; returns it."""
    global _CURRENT
    if device.type != "cuda":
        _CURRENT = DutyCycle(fraction, False, "cpu_backend")
    elif fraction >= 1.0:
        _CURRENT = DutyCycle(fraction, False, "no_limit")
    else:
        sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
        _CURRENT = DutyCycle(fraction, True, "", synchronize=sync)
    _CURRENT.start()
    return _CURRENT


def tick() -> None:
    _CURRENT.tick()


def current() -> DutyCycle:
    """The limiter of the run this process started last (its report and observed share)."""
    return _CURRENT
