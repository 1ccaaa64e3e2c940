"""Optimizers and learning-rate schedules, built from [training] and [optimizer]."""

from retrograd.optim.build import base_lr, build_optimizer, lr_at

__all__ = ["base_lr", "build_optimizer", "lr_at"]
