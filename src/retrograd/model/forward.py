"""What one forward call shares with every layer: `ForwardContext` (rope tables, masks, the
cache, dtypes and the compute plan's switches, read once per call) and `Mode` (how the call
computes: dtype, fused kernels, inside a compiled graph, llama.cpp's f16 GELU).

Built by the decoder (model/decoder.py) for each call and read by each layer's step
(model/block.py); knows the model's configuration and the cache, nothing of the layers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from retrograd import compute
from retrograd.model.config import ModelConfig
from retrograd.model.kv_cache import KVCache
from retrograd.model.rope import rope_angles


class Mode(NamedTuple):
    """How this call computes: dtype, the compute dtype; fuse, the fused 16-bit kernels
    (False: float32's plain operations); inline, inside a graph compiled whole (the fused
    kernels' bodies run there); f16_gelu, llama.cpp's f16 GELU table (float32 only)."""

    dtype: torch.dtype
    fuse: bool
    inline: bool = False
    f16_gelu: bool = False


class ForwardContext:
    """Per-call values shared by all layers: rope tables, masks, cache, dtypes, and the compute
    plan's switches (`plan`, read once per forward: retrograd/compute.py)."""

    def __init__(
        self,
        cfg: ModelConfig,
        T: int,
        start: int,
        cache: KVCache | None,
        dtype: torch.dtype,
        device: torch.device,
        freq_factors: torch.Tensor | None,
        f16_gelu: bool,
        key_mask: torch.Tensor | None,
        positions: torch.Tensor | None = None,
    ):
        self.dtype, self.cache, self.start, self.f16_gelu = dtype, cache, start, f16_gelu
        self.plan = compute.current()
        self.T, self.B = T, 1  # the decoder sets B, the batch size
        # (B, T): False at left padding, where a recurrent layer must keep its state as it is
        self.valid = None if key_mask is None else key_mask[:, start : start + T]
        # NOTE: float32 is the exactness path: plain eager operations, as the oracle tests saw
        self.fuse = dtype != torch.float32 if self.plan.fuse is None else self.plan.fuse
        self.mode = Mode(dtype, self.fuse, False, f16_gelu)
        if positions is None:  # shared by the batch: cache slot = position
            positions = torch.arange(start, start + T, device=device)  # (T,)
        self.rope = _angles(
            positions, cfg, cfg.rope_base, cfg.rope_freq_scale, cfg.yarn, freq_factors
        )
        self.rope_swa = self.rope
        if any(cfg.swa_layers):  # llama.cpp: no YaRN and no linear scale in window layers
            scale = cfg.rope_freq_scale_swa  # (but gpt-oss's window layers keep them)
            yarn = cfg.yarn if cfg.arch.swa_rope_scaled else None
            self.rope_swa = _angles(positions, cfg, cfg.rope_base_swa, scale, yarn, freq_factors)
        self.q_temp = _temperature(positions, cfg) if cfg.attn_temp_scale else None
        S = start + T
        needs_mask = cache is not None and start > 0 or key_mask is not None
        self.mask = _causal_mask(T, S, 0, device, key_mask) if needs_mask else None
        self.mask_swa = self.mask
        if cfg.swa_window and S > cfg.swa_window:
            self.mask_swa = _causal_mask(T, S, cfg.swa_window, device, key_mask)

    def state(self, il: int) -> tuple[torch.Tensor, ...] | None:
        """Layer il's recurrent state before position `start` (batch first), or None at the
        start of the sequences (a zero state)."""
        if self.cache is None or self.start == 0:
            return None
        return self.cache.read_state(il, self.start, self.B)

    def keep(self, il: int, state: tuple[torch.Tensor, ...]) -> None:
        """Layer il's recurrent state after the last position, for the next call."""
        if self.cache is not None:
            self.cache.write_state(il, self.start, self.start + self.T, state)


def _temperature(positions: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """mistral3 (llama 4's temperature tuning): each query times 1 + s ln(floor(p / n) + 1),
    in float64 as llama.cpp fills its input -> (T, 1, 1) or (B, T, 1, 1) float32."""
    p = positions.clamp(min=0).to(torch.float32) / float(cfg.attn_temp_floor)
    t = torch.log(torch.floor(p).double() + 1.0) * cfg.attn_temp_scale + 1.0
    return t.float()[..., None, None]


def _angles(positions: torch.Tensor, cfg: ModelConfig, base: float, scale: float, yarn, factors):
    """cos, sin of shared positions (T,) -> (T, n_rot/2), or per sequence (B, T) -> (B, T, n_rot/2)."""
    cos, sin = rope_angles(positions.reshape(-1), cfg.n_rot, base, scale, factors, yarn)
    return cos.view(*positions.shape, -1), sin.view(*positions.shape, -1)


def _causal_mask(T: int, S: int, window: int, device, key_mask) -> torch.Tensor:
    """(T, S) or (B, 1, T, S) bool, True where query t (at S - T + t) may see key s."""
    p1 = torch.arange(S - T, S, device=device)[:, None]
    p0 = torch.arange(S, device=device)[None, :]
    mask = p0 <= p1
    if window:
        mask &= (p1 - p0) < window
    if key_mask is not None:  # (B, S): False for padding keys
        # NOTE: a padding query sees at least itself, so its row stays finite (no NaN reaches
        # the cache); real queries already see their own key, so nothing else changes.
        mask = mask[None, None] & key_mask[:, None, None, :] | (p0 == p1)
    return mask
