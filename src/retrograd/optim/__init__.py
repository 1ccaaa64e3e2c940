"""Optimizers and learning-rate schedules, built from [training] and [optimizer]."""

from retrograd.optim.build import build_optimizer, lr_at

__all__ = ["build_optimizer", "lr_at"]
