"""Rotary position embeddings in the file's own pairing, computed as ggml computes them.

NORM rotates consecutive pairs (2i, 2i+1), NEOX rotates (i, i + n_rot/2); dimensions past
n_rot pass through. Angles follow ggml's rope cache: theta starts at the position and is
multiplied by base^(-2/n_rot) once per pair, in float32, so that our angles round like
llama.cpp's. YaRN (ggml's rope_yarn) blends each pair's interpolated and extrapolated angle by
a ramp over the pairs and scales cos and sin by its magnitude factor. Knows nothing about
attention or weights.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from retrograd.model.arch import ROPE_NEOX
from retrograd.model.config import Yarn, logf

f32 = np.float32


def rope_angles(
    positions: torch.Tensor,
    n_rot: int,
    base: float,
    freq_scale: float = 1.0,
    freq_factors: torch.Tensor | None = None,
    yarn: Yarn | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (T, n_rot/2) float32, for integer positions (T,)."""
    if n_rot == 0:  # a model without attention (mamba2)
        empty = torch.zeros(positions.numel(), 0, device=positions.device)
        return empty, empty
    half = n_rot // 2
    theta_scale = float(np.float32(base) ** np.float32(-2.0 / n_rot))
    steps = torch.full(
        (positions.numel(), half), theta_scale, dtype=torch.float32, device=positions.device
    )
    steps[:, 0] = positions.to(torch.float32)
    theta = torch.cumprod(steps, dim=-1)  # (T, half): p, p*s, (p*s)*s, ...
    if freq_factors is not None:
        theta = theta / freq_factors.to(theta)
    if yarn is not None and yarn.ext_factor != 0.0:
        return _yarn(theta, n_rot, base, freq_scale, yarn)
    if freq_scale != 1.0:
        theta = theta * freq_scale
    cos, sin = torch.cos(theta), torch.sin(theta)
    if yarn is not None and yarn.attn_factor != 1.0:
        cos, sin = cos * yarn.attn_factor, sin * yarn.attn_factor
    return cos, sin


def _yarn(theta: torch.Tensor, n_rot: int, base: float, freq_scale: float, yarn: Yarn):
    """ggml's rope_yarn on extrapolated angles (T, n_rot/2): pair i takes the interpolated angle
    (theta * freq_scale) past the high correction dim, the extrapolated one below the low one, a
    linear blend between; cos and sin carry attn_factor * (1 + 0.1 ln(1/freq_scale))."""
    low, high = yarn_corr_dims(n_rot, yarn.n_ctx_orig, base, yarn.beta_fast, yarn.beta_slow)
    pair = torch.arange(theta.shape[-1], dtype=torch.float32, device=theta.device)
    y = (pair - float(low)) / float(max(f32(0.001), f32(high - low)))
    ramp = (1.0 - y.clamp(0.0, 1.0)) * yarn.ext_factor  # (n_rot/2,)
    interp = theta * float(f32(freq_scale))
    theta = interp * (1.0 - ramp) + theta * ramp
    mscale = f32(yarn.attn_factor) * (f32(1.0) + f32(0.1) * logf(f32(1.0) / f32(freq_scale)))
    return torch.cos(theta) * float(mscale), torch.sin(theta) * float(mscale)


def yarn_corr_dims(
    n_rot: int, n_ctx_orig: int, base: float, beta_fast: float, beta_slow: float
) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims: the pairs where YaRN's ramp starts and ends, in float32."""

    def corr_dim(n_turns: float) -> np.float32:
        ratio = f32(n_ctx_orig) / (f32(n_turns) * f32(2) * f32(math.pi))
        return f32(n_rot) * logf(ratio) / (f32(2) * logf(f32(base)))

    low = max(f32(0), f32(math.floor(corr_dim(beta_fast))))
    high = min(f32(n_rot - 1), f32(math.ceil(corr_dim(beta_slow))))
    return float(low), float(high)


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
