"""Kernels for the 256-element super-block types with plain integer codes: the K-quants
(Q2_K..Q6_K), IQ4_XS and the ternary TQ1_0/TQ2_0.

Each takes (n_blocks, type_size) uint8 and returns (n_blocks, 256) float32, equal bit for bit
to gguf-py's `dequantize_blocks`. Sub-block scales are tiny (n, 8 or 16) tensors; the cost is
in the (n, 256) passes, so each kernel makes as few of those as it can.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from retrograd.model.dequant_blocks import bit_planes, f16, gather_rows, nibbles, shifts
from retrograd.model.dequant_legacy import _iq4nl_values


def q2_k(b: torch.Tensor) -> torch.Tensor:
    """scales: 16 bytes (low nibble scale, high nibble min), qs: 64 bytes of 2-bit codes,
    d: f16, dmin: f16; x = d * sc * q - dmin * m per 16 values."""
    scales = b[:, :16]
    d, dmin = f16(b, 80), f16(b, 82)
    dl = (d * (scales & 0x0F)).unsqueeze(-1)  # (n, 16, 1)
    ml = (dmin * (scales >> 4)).unsqueeze(-1)
    q = bit_planes(b[:, 16:80].reshape(-1, 2, 32), 2, 3).reshape(-1, 16, 16)  # (n, 16, 16)
    return (dl * q).sub_(ml).reshape(-1, 256)


def q3_k(b: torch.Tensor) -> torch.Tensor:
    """hmask: 32 bytes (third bit, inverted), qs: 64 bytes of low 2 bits, scales: 12 bytes of
    6-bit scales (offset 32), d: f16."""
    n = b.shape[0]
    d = f16(b, 108)
    packed = b[:, 96:108]
    low = nibbles(packed[:, :8]).reshape(n, 16)  # (n, 16): scales 0-7 then 8-15
    high = bit_planes(packed[:, 8:12], 2, 3).reshape(n, 16)
    sc = (low | (high << 4)).view(torch.int8) - 32
    dl = (d * sc).unsqueeze(-1)  # (n, 16, 1)
    ql = bit_planes(b[:, 32:96].reshape(n, 2, 32), 2, 3)  # (n, 2, 4, 32)
    qh = bit_planes(b[:, :32].reshape(n, 1, 32), 1, 1)  # (n, 1, 8, 32)
    # a set hmask bit means "no -4 offset": ql - 4 * (1 - h) == (ql | h << 2) - 4
    q = (ql.reshape(n, 16, 16) | (qh.reshape(n, 16, 16) << 2)).view(torch.int8) - 4
    return (dl * q).reshape(n, 256)


def _scale_min_k4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes of eight 6-bit scales and eight 6-bit mins (ggml's get_scale_min_k4)."""
    s = packed.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)  # (n, 8)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _k4_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K header: d, dmin, 12 scale bytes -> per-32 (n, 8, 1) scale and min."""
    d, dmin = f16(b, 0), f16(b, 2)
    sc, mn = _scale_min_k4(b[:, 4:16])
    return (d * sc).unsqueeze(-1), (dmin * mn).unsqueeze(-1)


def q4_k(b: torch.Tensor) -> torch.Tensor:
    """d, dmin: f16, scales: 12 bytes, qs: 128 bytes of 4-bit codes (32 bytes per 64 values)."""
    n = b.shape[0]
    dl, ml = _k4_scales(b)
    q = nibbles(b[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32)
    return (dl * q).sub_(ml).reshape(n, 256)


def q5_k(b: torch.Tensor) -> torch.Tensor:
    """d, dmin: f16, scales: 12 bytes, qh: 32 bytes of fifth bits, qs: 128 bytes of low 4."""
    n = b.shape[0]
    dl, ml = _k4_scales(b)
    ql = nibbles(b[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32)
    qh = bit_planes(b[:, 16:48], 1, 1)  # (n, 8, 32)
    q = ql | (qh << 4)
    return (dl * q).sub_(ml).reshape(n, 256)


def q6_k(b: torch.Tensor) -> torch.Tensor:
    """ql: 128 bytes of low 4 bits, qh: 64 bytes of high 2 bits, scales: 16 int8, d: f16."""
    n = b.shape[0]
    dl = (f16(b, 208) * b[:, 192:208].view(torch.int8)).unsqueeze(-1)  # (n, 16, 1)
    ql = nibbles(b[:, :128].reshape(n, 2, 64)).reshape(n, 8, 32)
    qh = bit_planes(b[:, 128:192].reshape(n, 2, 32), 2, 3).reshape(n, 8, 32)
    q = (ql | (qh << 4)).view(torch.int8) - 32
    return (dl * q.reshape(n, 16, 16)).reshape(n, 256)


def iq4_xs(b: torch.Tensor) -> torch.Tensor:
    """d: f16, scales_h: uint16 of 2-bit highs, scales_l: 4 bytes of 4-bit lows (offset 32),
    qs: 128 bytes of 4-bit indices into IQ4_NL's table."""
    n = b.shape[0]
    low = nibbles(b[:, 4:8]).transpose(1, 2).reshape(n, 8)
    high = bit_planes(b[:, 2:4], 2, 3, dim=-1).reshape(n, 8)
    sc = (low | (high << 4)).view(torch.int8) - 32
    dl = (f16(b, 0) * sc).unsqueeze(-1)  # (n, 8, 1)
    idx = nibbles(b[:, 8:].reshape(n, 8, 16)).reshape(n, 8, 32)
    v = gather_rows(_iq4nl_values(b.device), idx).reshape(n, 8, 32)
    return (dl * v).reshape(n, 256)


def tq1_0(b: torch.Tensor) -> torch.Tensor:
    """qs: 48 bytes of five base-3 digits, qh: 4 bytes of four, d: f16 (at byte 52).

    A digit is read by multiplying the byte by 3^k modulo 256 and taking the top of 3x.
    """
    n = b.shape[0]
    p5 = shifts((1, 3, 9, 27, 81), (5, 1), b.device)
    q0 = (b[:, :32].unsqueeze(1) * p5).reshape(n, 160)  # uint8 product wraps, as in ggml
    q1 = (b[:, 32:48].unsqueeze(1) * p5).reshape(n, 80)
    qh = (b[:, 48:52].unsqueeze(1) * p5[:4]).reshape(n, 16)
    q = torch.cat((q0, q1, qh), dim=-1).int()
    t = ((q * 3) >> 8).to(torch.int8) - 1  # (n, 256) in -1..1
    return t * f16(b, 52)


def tq2_0(b: torch.Tensor) -> torch.Tensor:
    """qs: 64 bytes of 2-bit codes (value - 1), d: f16 (at byte 64)."""
    q = bit_planes(b[:, :64].reshape(-1, 2, 32), 2, 3).reshape(-1, 256)
    return (q.view(torch.int8) - 1) * f16(b, 64)


KERNELS = {
    T.Q2_K: q2_k,
    T.Q3_K: q3_k,
    T.Q4_K: q4_k,
    T.Q5_K: q5_k,
    T.Q6_K: q6_k,
    T.IQ4_XS: iq4_xs,
    T.TQ1_0: tq1_0,
    T.TQ2_0: tq2_0,
}
