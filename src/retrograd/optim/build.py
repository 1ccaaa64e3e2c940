"""Optimizers (AdamW, SGD, Muon, Gefen) and schedules with warm-up.

Weight decay is decoupled for every optimizer (AdamW natively; SGD here by shrinking the
weights before the step), as the reference specifies. Schedules are a pure function of the
step (`lr_at`) so that resume restores them from the step alone.
"""

from __future__ import annotations

import math

import torch

from retrograd.errors import ConfigError
from retrograd.optim.muon import adamw, muon_with_adamw


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
    """The rate the schedule scales: training.lr, or with Muon and no base matrix to train
    (lora, hybrid) its fallback_learning_rate, since Muon then leaves every trained parameter
    to AdamW at that rate (configuration reference, [optimizer.muon])."""
    if training.optimizer == "muon" and training.trainable not in ("full", "partial"):
        muon = optimizer_cfg.muon if optimizer_cfg is not None else None
        return muon.fallback_learning_rate if muon is not None else 1e-3
    return training.lr


def build_optimizer(
    params: list[torch.nn.Parameter], training, optimizer_cfg=None, matrices=()
) -> torch.optim.Optimizer:
    """The run's optimizer over `params`. `matrices`: those of `params` that are 2-D hidden
    weight matrices of the base model (Muon's share; every other parameter, LoRA factors
    included, goes to AdamW)."""
    kind = training.optimizer
    lr, wd = base_lr(training, optimizer_cfg), training.weight_decay
    if kind in ("muon", "gefen"):
        _check_f32(params, kind)
    if kind == "adamw":
        return adamw(params, lr, wd)
    if kind == "muon":
        from retrograd.config.training import MuonSection

        muon = (optimizer_cfg.muon if optimizer_cfg is not None else None) or MuonSection()
        chosen = {id(p) for p in matrices}
        others = [p for p in params if id(p) not in chosen]
        return muon_with_adamw([p for p in params if id(p) in chosen], others, lr, wd, muon)
    if kind == "gefen":
        from retrograd.config.training import GefenSection
        from retrograd.optim.gefen import gefen_with_adamw

        gefen = (optimizer_cfg.gefen if optimizer_cfg is not None else None) or GefenSection()
        return gefen_with_adamw(params, lr, wd, gefen)
    if kind == "sgd":
        return DecoupledSGD(params, lr=lr, weight_decay=wd)
    raise ConfigError(f"[training].optimizer = {kind!r}: must be adamw, sgd, muon or gefen")


def _check_f32(params: list[torch.nn.Parameter], kind: str) -> None:
    wrong = sorted(
        {str(p.dtype).removeprefix("torch.") for p in params if p.dtype != torch.float32}
    )
    if wrong:
        raise ConfigError(
            f"[training].optimizer = {kind!r}: updates f32 weights only, and {', '.join(wrong)} "
            'weights train here; set [training].master_weights = "auto" (an f32 master copy) '
            "or use adamw or sgd"
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
