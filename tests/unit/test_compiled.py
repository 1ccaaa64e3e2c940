"""Fused kernels: compiled on first use, eager when asked or when compiling cannot work."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from retrograd.compiled import fused


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _frames() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def test_dispatch_mode_runs_eagerly_once_and_compiling_resumes(monkeypatch):
    monkeypatch.setenv("RETRO_COMPILE", "1")

    @fused(dynamic={0: (0,)})
    def scaled_softmax(x: torch.Tensor, t: float) -> torch.Tensor:
        return torch.softmax(x * t, -1)

    x = torch.randn(5, 7)
    with _Count() as mode:  # an audit sees every eager op: nothing was compiled away
        eager = scaled_softmax(x, 0.5)
    assert mode.ops >= 2
    before = _frames()
    compiled = scaled_softmax(x, 0.5)
    assert _frames() == before + 1  # compiled after all
    torch.testing.assert_close(compiled, eager)
    scaled_softmax(torch.randn(9, 7), 0.5)  # rows are dynamic: no new graph
    assert _frames() == before + 1


def test_retro_compile_0_is_the_plain_function(monkeypatch):
    monkeypatch.setenv("RETRO_COMPILE", "0")

    @fused(dynamic={0: (0,)})
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    before = _frames()
    assert torch.equal(double(torch.ones(3)), torch.full((3,), 2.0))
    assert _frames() == before and double.eager(torch.ones(1)).item() == 2.0
