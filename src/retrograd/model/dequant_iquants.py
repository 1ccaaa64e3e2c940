"""Kernels for the lattice ("grid") i-quants: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S,
IQ1_M.

Each code indexes a row of a fixed grid of 4 or 8 values; signs come as bits or as 7-bit
indices into ggml's `ksigns` table. The grids and sign tables are read from gguf-py at first
use (so they are the oracle's own) and kept once per device. Each kernel returns
(n_blocks, 256) float32, equal bit for bit to gguf-py's `dequantize_blocks`.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from retrograd.model.dequant_blocks import bit_planes, constant, f16, gather_rows, shifts, u16


def _grid(cls) -> np.ndarray:
    cls.init_grid()
    return cls.grid.reshape(cls.grid_shape).astype(np.float32)


def grid(name: str, device: torch.device) -> torch.Tensor:
    return constant(f"grid_{name}", device, lambda: _grid(getattr(quants, name)))


def _signs_of(byte_values: np.ndarray) -> np.ndarray:
    """(k,) bytes -> (k, 8) of +-1: bit i set means value i is negative."""
    bits = (byte_values[:, None] >> np.arange(8, dtype=np.uint8)) & 1
    return np.where(bits == 0, np.float32(1), np.float32(-1))


def _sign_bits(device: torch.device) -> torch.Tensor:
    """(256, 8) of +-1 for a byte of 8 sign bits."""
    return constant("sign_bits", device, lambda: _signs_of(np.arange(256, dtype=np.uint8)))


def _ksigns(device: torch.device) -> torch.Tensor:
    """(128, 8) of +-1: the sign pattern of each 7-bit ksigns index (parity in bit 7)."""
    ksigns = np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8)
    return constant("ksigns", device, lambda: _signs_of(ksigns))


def _aux_words(b: torch.Tensor, offset: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` uint32 words from byte `offset`: (low 28 bits as int32, top 4 bits), each
    (n, count). The low bits hold four 7-bit ksigns indices, the top the sub-block scale."""
    raw = b[:, offset : offset + 4 * count].reshape(-1, count, 4).int()
    low = raw[..., 0] | (raw[..., 1] << 8) | (raw[..., 2] << 16) | ((raw[..., 3] & 0x0F) << 24)
    return low, raw[..., 3] >> 4


def _ksign_index(low: torch.Tensor) -> torch.Tensor:
    """(n, k) words -> (n, k, 4) 7-bit ksigns indices."""
    s = shifts((0, 7, 14, 21), (4,), low.device, torch.int32)
    return (low.unsqueeze(-1) >> s) & 0x7F


def _half_scale(d: torch.Tensor, s: torch.Tensor, factor: float) -> torch.Tensor:
    """gguf-py's d * (0.5 + s) * factor, in its order, as (n, k, 1, 1)."""
    return (d * (s.float() + 0.5) * factor).reshape(*s.shape, 1, 1)


def iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    """d: f16, then 8 x (4 grid-index bytes, uint32 of 4 ksigns indices + 4-bit scale)."""
    n = b.shape[0]
    words = b[:, 2:].reshape(n, 8, 8)
    low, s = _aux_words(words[:, :, 4:].reshape(n, 32), 0, 8)  # (n, 8)
    db = _half_scale(f16(b, 0), s, 0.25)  # (n, 8, 1, 1)
    signs = gather_rows(_ksigns(b.device), _ksign_index(low))  # (n, 8, 4, 8)
    g = gather_rows(grid("IQ2_XXS", b.device), words[:, :, :4])  # (n, 8, 4, 8)
    return g.mul_(db).mul_(signs).view(n, 256)  # (db * grid) * signs, in place


def iq2_xs(b: torch.Tensor) -> torch.Tensor:
    """d: f16, qs: 32 uint16 (9-bit grid index, 7-bit ksigns index), scales: 8 bytes of 4-bit."""
    n = b.shape[0]
    qs = u16(b, 2, 32)  # (n, 32)
    sc = bit_planes(b[:, 66:74], 4, 0x0F, dim=-1).reshape(n, 16)
    db = _half_scale(f16(b, 0), sc, 0.25)  # (n, 16, 1, 1)
    signs = gather_rows(_ksigns(b.device), qs >> 9).reshape(n, 16, 2, 8)
    g = gather_rows(grid("IQ2_XS", b.device), qs & 511).reshape(n, 16, 2, 8)
    return g.mul_(db).mul_(signs).view(n, 256)  # (db * grid) * signs, in place


def iq2_s(b: torch.Tensor) -> torch.Tensor:
    """d: f16, qs: 32 bytes (low 8 index bits), signs: 32 bytes of bits, qh: 8 bytes of the
    top 2 index bits, scales: 8 bytes of 4-bit."""
    n = b.shape[0]
    sc = bit_planes(b[:, 74:82], 4, 0x0F, dim=-1).reshape(n, 16)
    db = _half_scale(f16(b, 0), sc, 0.25)  # (n, 16, 1, 1)
    signs = gather_rows(_sign_bits(b.device), b[:, 34:66]).reshape(n, 16, 2, 8)
    qh = bit_planes(b[:, 66:74], 2, 3, dim=-1).reshape(n, 32).int()
    idx = b[:, 2:34].int() | (qh << 8)
    g = gather_rows(grid("IQ2_S", b.device), idx).reshape(n, 16, 2, 8)
    return g.mul_(db).mul_(signs).view(n, 256)  # (db * grid) * signs, in place


def iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    """d: f16, qs: 64 grid-index bytes, then 8 uint32 of 4 ksigns indices + 4-bit scale."""
    n = b.shape[0]
    low, s = _aux_words(b, 66, 8)
    db = _half_scale(f16(b, 0), s, 0.5)  # (n, 8, 1, 1)
    signs = gather_rows(_ksigns(b.device), _ksign_index(low))  # (n, 8, 4, 8)
    g = gather_rows(grid("IQ3_XXS", b.device), b[:, 2:66]).reshape(n, 8, 4, 8)
    return g.mul_(db).mul_(signs).view(n, 256)  # (db * grid) * signs, in place


def iq3_s(b: torch.Tensor) -> torch.Tensor:
    """d: f16, qs: 64 bytes (low 8 index bits), qh: 8 bytes (9th bits), signs: 32 bytes of
    bits, scales: 4 bytes of 4-bit (odd multipliers 1 + 2s)."""
    n = b.shape[0]
    sc = bit_planes(b[:, 106:110], 4, 0x0F, dim=-1).reshape(n, 8)
    db = (f16(b, 0) * (sc * 2 + 1)).reshape(n, 8, 1, 1)
    signs = gather_rows(_sign_bits(b.device), b[:, 74:106]).reshape(n, 8, 4, 8)
    qh = bit_planes(b[:, 66:74], 1, 1, dim=-1).reshape(n, 64).int()
    idx = b[:, 2:66].int() | (qh << 8)
    g = gather_rows(grid("IQ3_S", b.device), idx).reshape(n, 8, 4, 8)
    return g.mul_(db).mul_(signs).view(n, 256)  # (db * grid) * signs, in place


def _delta(negative: torch.Tensor) -> torch.Tensor:
    """IQ1 grid offset: -1/8 where the flag is set, +1/8 elsewhere (float32)."""
    delta = float(quants.IQ1_S.delta)
    return torch.where(negative, -delta, delta).float()


def iq1_s(b: torch.Tensor) -> torch.Tensor:
    """d: f16, qs: 32 bytes (low 8 index bits), qh: 8 uint16 (4 x 3 high index bits,
    3-bit scale, delta sign)."""
    n = b.shape[0]
    qh = u16(b, 34, 8)  # (n, 8)
    dl = (f16(b, 0) * (((qh >> 12) & 7) * 2 + 1)).reshape(n, 8, 1, 1)
    delta = _delta((qh & 0x8000) != 0).reshape(n, 8, 1, 1)
    high = (qh.unsqueeze(-1) >> shifts((0, 3, 6, 9), (4,), b.device, torch.int32)) & 7
    idx = b[:, 2:34].int() | (high.reshape(n, 32) << 8)
    g = gather_rows(grid("IQ1_S", b.device), idx).reshape(n, 8, 4, 8)
    return g.add_(delta).mul_(dl).view(n, 256)  # dl * (grid + delta), in place


def iq1_m(b: torch.Tensor) -> torch.Tensor:
    """qs: 32 bytes (low 8 index bits), qh: 16 bytes (two nibbles of 3 high bits + delta
    sign), scales: 4 uint16 of 3-bit scales whose top nibbles together form the f16 d."""
    n = b.shape[0]
    top = b[:, 49:56:2]  # high bytes of the 4 uint16 (n, 4)
    d_bytes = torch.stack(
        ((top[:, 0] >> 4) | (top[:, 1] & 0xF0), (top[:, 2] >> 4) | (top[:, 3] & 0xF0)), dim=-1
    )
    d = d_bytes.view(torch.float16).float()  # (n, 1)
    scales = u16(b, 48, 4)
    sc = (scales.unsqueeze(-1) >> shifts((0, 3, 6, 9), (4,), b.device, torch.int32)) & 7
    dl = (d * (sc.reshape(n, 16) * 2 + 1)).reshape(n, 8, 2, 1, 1)
    qh = bit_planes(b[:, 32:48], 4, 0x0F, dim=-1).reshape(n, 32)
    idx = b[:, :32].int() | ((qh & 7).int() << 8)
    delta = _delta((qh & 8) != 0).reshape(n, 8, 2, 2, 1)
    g = gather_rows(grid("IQ1_M", b.device), idx).reshape(n, 8, 2, 2, 8)
    return g.add_(delta).mul_(dl).view(n, 256)  # dl * (grid + delta), in place


KERNELS = {
    T.IQ2_XXS: iq2_xxs,
    T.IQ2_XS: iq2_xs,
    T.IQ2_S: iq2_s,
    T.IQ3_XXS: iq3_xxs,
    T.IQ3_S: iq3_s,
    T.IQ1_S: iq1_s,
    T.IQ1_M: iq1_m,
}
