"""Rotary position embeddings in the file's own pairing, computed as ggml computes them.

NORM rotates consecutive pairs (2i, 2i+1), NEOX rotates (i, i + n_rot/2); dimensions past
n_rot pass through. Angles follow ggml's rope cache: theta starts at the position and is
multiplied by base^(-2/n_rot) once per pair, in float32, so that our angles round like
llama.cpp's. Knows nothing about attention or weights.
"""

from __future__ import annotations

import numpy as np
import torch

from retrograd.model.arch import ROPE_NEOX


def rope_angles(
    positions: torch.Tensor,
    n_rot: int,
    base: float,
    freq_scale: float = 1.0,
    freq_factors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (T, n_rot/2) float32, for integer positions (T,)."""
    half = n_rot // 2
    theta_scale = float(np.float32(base) ** np.float32(-2.0 / n_rot))
    steps = torch.full(
        (positions.numel(), half), theta_scale, dtype=torch.float32, device=positions.device
    )
    steps[:, 0] = positions.to(torch.float32)
    theta = torch.cumprod(steps, dim=-1)  # (T, half): p, p*s, (p*s)*s, ...
    if freq_factors is not None:
        theta = theta / freq_factors.to(theta)
    if freq_scale != 1.0:
        theta = theta * freq_scale
    return torch.cos(theta), torch.sin(theta)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """x (B, T, H, D) in any float dtype -> rotated, float32. cos, sin (T, n_rot/2) shared by
    the batch, or (B, T, n_rot/2) per sequence."""
    x = x.float()
    n_rot = cos.shape[-1] * 2
    cos = cos[:, :, None, :] if cos.dim() == 3 else cos[None, :, None, :]  # (B|1, T, 1, n_rot/2)
    sin = sin[:, :, None, :] if sin.dim() == 3 else sin[None, :, None, :]
    rot, rest = x[..., :n_rot], x[..., n_rot:]
    if style == ROPE_NEOX:
        x0, x1 = rot[..., : n_rot // 2], rot[..., n_rot // 2 :]
        out = torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    else:
        x0, x1 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    if rest.shape[-1]:
        out = torch.cat((out, rest), dim=-1)
    return out
