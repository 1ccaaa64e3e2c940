"""max_gpu_duty_cycle: the limiter's arithmetic on a fake clock, and its report on a CPU."""

from __future__ import annotations

import pytest
import torch

from retrograd.algorithms import duty


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.mark.parametrize("fraction, rest", [(0.5, 0.2), (0.25, 0.6), (0.8, 0.05)])
def test_a_window_earns_its_rest(fraction, rest):
    clock = FakeClock()
    limiter = duty.DutyCycle(fraction, True, "", clock=clock, sleep=clock.sleep)
    limiter.start()
    for _ in range(3):
        clock.now += 0.2  # a 200 ms window of work up to the optimizer step
        limiter.tick()
    assert clock.slept == [pytest.approx(rest)] * 3
    assert limiter.observed == pytest.approx(fraction)
    assert clock.now == pytest.approx(0.6 + 3 * rest)


def test_on_a_cpu_it_is_accepted_and_reported_inactive():
    clock = FakeClock()
    limiter = duty.configure(0.5, torch.device("cpu"))
    limiter.sleep = clock.sleep
    limiter.tick()
    assert clock.slept == []
    assert limiter.report() == [
        "gpu_duty_cycle_requested: 0.5",
        "gpu_duty_cycle_active: false",
        "gpu_duty_cycle_reason: cpu_backend",
    ]
    duty.configure(1.0, torch.device("cpu"))
