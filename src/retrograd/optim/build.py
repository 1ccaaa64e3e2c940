"""Optimizers (AdamW, SGD; Muon's AdamW fallback for adapters) and schedules with warm-up.

Weight decay is decoupled for every optimizer (AdamW natively; SGD here by shrinking the
weights before the step), as the reference specifies. Schedules are a pure function of the
step (`lr_at`) so that resume restores them from the step alone.
"""

from __future__ import annotations

import math

import torch

from retrograd.errors import ConfigError


class DecoupledSGD(torch.optim.SGD):
    """Plain SGD with decoupled weight decay: w <- w - lr * wd * w, then the gradient step."""

    def __init__(self, params, lr: float, weight_decay: float):
        super().__init__(params, lr=lr, weight_decay=0.0)
        self.decoupled_weight_decay = weight_decay

    @torch.no_grad()
    def step(self, closure=None):
        if self.decoupled_weight_decay:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.mul_(1 - group["lr"] * self.decoupled_weight_decay)
        return super().step(closure)


def base_lr(training, optimizer_cfg=None) -> float:
    """The rate the schedule scales for the trained parameters: training.lr, or with Muon
    its fallback_learning_rate, since Muon leaves every LoRA factor to AdamW at that rate
    (configuration reference, [optimizer.muon])."""
    if training.optimizer == "muon":
        muon = optimizer_cfg.muon if optimizer_cfg is not None else None
        return muon.fallback_learning_rate if muon is not None else 1e-3
    return training.lr


def build_optimizer(
    params: list[torch.nn.Parameter], training, optimizer_cfg=None
) -> torch.optim.Optimizer:
    """The run's optimizer over `params` (all LoRA factors, which Muon leaves to AdamW)."""
    kind = training.optimizer
    lr, wd = base_lr(training, optimizer_cfg), training.weight_decay
    if kind in ("adamw", "muon"):
        # Muon orthogonalizes 2-D hidden weights; LoRA factors are not among them.
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd, betas=(0.9, 0.999), eps=1e-8)
    if kind == "sgd":
        return DecoupledSGD(params, lr=lr, weight_decay=wd)
    raise ConfigError(
        f"[training].optimizer = {kind!r}: not available for adapter training in this version "
        "(use adamw, sgd or muon)"
    )


def lr_at(step: int, total: int, base: float, kind: str, warmup: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warm-up, then the schedule."""
    if warmup and step < warmup:
        return base * (step + 1) / warmup
    if kind == "constant" or total <= warmup:
        return base
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "linear":
        return base * (1.0 - progress)
    if kind == "cosine":
        return base * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ConfigError(f"[training].lr_scheduler = {kind!r}: must be constant, linear or cosine")
