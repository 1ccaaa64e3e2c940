"""Muon and Gefen: the algorithms as written down, their memory, and exact save and restore."""

from __future__ import annotations

import math

import pytest
import torch

from retrograd.checkpoint.optim import optimizer_state, restore_optimizer
from retrograd.config.training import GefenSection, MuonSection
from retrograd.optim.gefen import Gefen, gefen_with_adamw
from retrograd.optim.muon import AdamW16, Joined, muon_with_adamw, stochastic_round


def newton_schulz(g: torch.Tensor, steps: int, eps: float) -> torch.Tensor:
    """Keller Jordan's quintic iteration (github.com/KellerJordan/Muon), written out: bf16,
    the wide orientation, spectral norm at most 1 by the Frobenius norm."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.bfloat16()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def direct_muon(w, grads, lr, momentum, nesterov, steps, eps, wd):
    """Muon by its definition: momentum buffer, Nesterov look-ahead, orthogonalized update
    scaled by sqrt(max(1, rows / cols)), decoupled weight decay."""
    w, buf = w.clone(), torch.zeros_like(w)
    for g in grads:
        buf = momentum * buf + (1 - momentum) * g
        update = (1 - momentum) * g + momentum * buf if nesterov else buf
        o = newton_schulz(update, steps, eps).float()
        w = w * (1 - lr * wd) - lr * math.sqrt(max(1, w.shape[0] / w.shape[1])) * o
    return w


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_the_algorithm_written_out(nesterov):
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(48, 32, generator=gen)
    grads = [torch.randn(48, 32, generator=gen) for _ in range(4)]
    cfg = MuonSection(momentum=0.9, nesterov=nesterov, ns_steps=4, ns_epsilon=1e-7)
    w = torch.nn.Parameter(w0.clone())
    opt = muon_with_adamw([w], [], 0.02, 0.1, cfg)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    want = direct_muon(w0, grads, 0.02, 0.9, nesterov, 4, 1e-7, 0.1)
    assert not torch.allclose(w.detach(), w0, atol=1e-3)  # it moved
    torch.testing.assert_close(w.detach(), want, atol=2e-3, rtol=0)


def test_muon_leaves_vectors_to_adamw_at_the_fallback_rate():
    m, v = torch.nn.Parameter(torch.ones(8, 8)), torch.nn.Parameter(torch.ones(8))
    opt = muon_with_adamw([m], [v], 0.02, 0.0, MuonSection(fallback_learning_rate=0.005))
    assert isinstance(opt, Joined)
    rates = [g["lr_scale"] for g in opt.param_groups]
    assert rates == [1.0, pytest.approx(0.25)]
    v.grad, m.grad = torch.ones(8), torch.ones(8, 8)
    for g in opt.param_groups:  # as step.clip_and_step sets them
        g["lr"] = 0.02 * g["lr_scale"]
    opt.step()
    torch.testing.assert_close(v.detach(), torch.full((8,), 1 - 0.005))  # Adam's first step


def _train(opt_of, steps: int, save_at: int | None = None):
    """Parameters after `steps` steps; with save_at, the optimizer is saved there as a
    checkpoint would, rebuilt from scratch and restored before the remaining steps."""
    gen = torch.Generator().manual_seed(1)
    params = [
        torch.nn.Parameter(torch.randn(64, 80, generator=gen)),
        torch.nn.Parameter(torch.randn(16, generator=gen)),
    ]
    names = ["w", "b"]
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(steps)]
    opt = opt_of(params)
    for i, gs in enumerate(grads):
        if i == save_at:
            saved = optimizer_state(opt, names, kind="x")
            opt = opt_of(params)
            restore_optimizer(opt, names, saved)
        for p, g in zip(params, gs, strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach().clone() for p in params]


OPTIMIZERS = {
    "muon": lambda ps: muon_with_adamw(ps[:1], ps[1:], 0.02, 0.01, MuonSection()),
    "gefen shared_v": lambda ps: gefen_with_adamw(
        ps, 1e-2, 0.01, GefenSection(block_size=256, min_numel=100)
    ),
    "gefen quantized_m": lambda ps: gefen_with_adamw(
        ps, 1e-2, 0.01, GefenSection(variant="quantized_m", block_size=256, min_numel=100)
    ),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_save_and_restore_continue_exactly(kind):
    whole = _train(OPTIMIZERS[kind], 5)
    cut = _train(OPTIMIZERS[kind], 5, save_at=3)
    for a, b in zip(whole, cut, strict=True):
        assert torch.equal(a, b)


def test_gefen_with_blocks_of_one_is_adamw():
    """One element per block makes the shared second moment Adam's own."""
    gen = torch.Generator().manual_seed(2)
    w0 = torch.randn(40, 30, generator=gen)
    grads = [torch.randn(40, 30, generator=gen) for _ in range(5)]
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    gefen = Gefen([a], lr=1e-2, weight_decay=0.1, block_size=1)
    adamw = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1, eps=1e-8)
    for g in grads:
        a.grad, b.grad = g.clone(), g.clone()
        gefen.step()
        adamw.step()
    torch.testing.assert_close(a.detach(), b.detach(), atol=1e-6, rtol=1e-5)


def test_gefen_quantized_first_moment_follows_the_full_one():
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(128, 64, generator=gen)
    grads = [torch.randn(128, 64, generator=gen) for _ in range(6)]
    moved = []
    for variant in ("shared_v", "quantized_m"):
        w = torch.nn.Parameter(w0.clone())
        opt = Gefen([w], lr=1e-2, variant=variant, block_size=64)
        for g in grads:
            w.grad = g.clone()
            opt.step()
        moved.append((w.detach() - w0).flatten())
    cos = torch.nn.functional.cosine_similarity(moved[0], moved[1], dim=0)
    assert cos > 0.99
    assert not torch.equal(moved[0], moved[1])


@pytest.mark.parametrize(
    "variant, expected", [("shared_v", 4.0039), ("quantized_m", 1.0078)], ids=str
)
def test_gefen_state_bytes_per_parameter(variant, expected):
    """formats.md §8.6: about 4.0 (shared_v) and 1.0 (quantized_m) bytes of optimizer state a
    parameter at block_size 1024, against 8.0 for AdamW; measured as a checkpoint stores it."""
    shapes = [(1024, 768), (768, 1024), (2048, 512)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    n = sum(p.numel() for p in params)
    names = [f"p{i}" for i in range(len(params))]

    def per_param(opt) -> float:
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        state = optimizer_state(opt, names, kind="x")
        return state.state_bytes / n

    adamw = per_param(torch.optim.AdamW(params, lr=1e-3))
    gefen = per_param(Gefen(params, lr=1e-3, variant=variant, block_size=1024))
    assert adamw == pytest.approx(8.0, abs=1e-3)
    assert gefen == pytest.approx(expected, abs=1e-3)


def test_adamw16_on_float32_is_pytorchs_adamw():
    gen = torch.Generator().manual_seed(4)
    w0 = torch.randn(20, 10, generator=gen)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    mine = AdamW16([a], lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1, eps=1e-8)
    for _ in range(4):
        g = torch.randn(20, 10, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        mine.step()
        ref.step()
    torch.testing.assert_close(a.detach(), b.detach(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_stochastic_rounding_is_unbiased(dtype):
    w = torch.full((200_000,), 1.0 + 1e-3 / 3)  # between two 16-bit neighbours of 1.0
    rounded = stochastic_round(w, dtype, seed=5)
    assert rounded.dtype == dtype and len(set(rounded.float().tolist())) == 2
    assert rounded.float().mean().item() == pytest.approx(w[0].item(), abs=2e-5)


def test_adamw16_trains_f16_weights_where_pytorchs_adamw_fails():
    """Gradients of 1e-4: PyTorch's AdamW over an f16 tensor divides 0 by 0 (its second moment
    and eps underflow); AdamW16 moves the weights, small steps kept in expectation."""
    w0 = torch.ones(4096, dtype=torch.float16)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    mine, ref = AdamW16([a], lr=1e-4), torch.optim.AdamW([b], lr=1e-4, eps=1e-8)
    for _ in range(3):
        a.grad, b.grad = torch.full_like(w0, 1e-4), torch.full_like(w0, 1e-4)
        mine.step()
        ref.step()
    assert not torch.isfinite(b.detach()).all()
    assert a.detach().float().mean().item() == pytest.approx(1 - 3e-4, abs=5e-5)
