"""Kernels for the 256-element super-block types with plain integer codes: the K-quants
(Q2_K..Q6_K), IQ4_XS and the ternary TQ1_0/TQ2_0.

Each takes (n_blocks, type_size) uint8 and returns (n_blocks, 256) float32, equal bit for bit
to gguf-py's `dequantize_blocks`. Sub-block scales are tiny (n, 8 or 16) tensors; the cost is
in the (n, 256) passes, so each kernel makes as few of those as it can.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from retrograd.model.dequant_blocks import (
    bit_planes,
    bytes_of,
    columns,
    f16,
    nibble_values,
    nibbles,
    planes,
    shifts,
    split_nibbles,
    words,
)


def q2_k(b: torch.Tensor) -> torch.Tensor:
    """scales: 16 bytes (low nibble scale, high nibble min), qs: 64 bytes of 2-bit codes,
    d: f16, dmin: f16; x = d * sc * q - dmin * m per 16 values."""
    n = b.shape[0]
    sc = nibbles(b[:, :16]).transpose(0, 1)  # (2, n, 16): scales, mins
    s = sc.float().mul_(f16(b, 80, 2).t().unsqueeze(-1))  # d * sc, dmin * m
    dl, ml = _columns(s)  # (n, 16, 1) each
    q = planes(words(b, 16, 80).view(n, 2, 4), 2, 3)  # (n, 2, 4, 4) words: (n, 16, 16) bytes
    return bytes_of(q, n, 16, 16).float().mul_(dl).sub_(ml).view(n, 256)


def q3_k(b: torch.Tensor) -> torch.Tensor:
    """hmask: 32 bytes (third bit, inverted), qs: 64 bytes of low 2 bits, scales: 12 bytes of
    6-bit scales (offset 32), d: f16."""
    n = b.shape[0]
    # scales: bytes 0-7 hold the low nibbles of scales 0-7 and 8-15, bytes 8-11 the high pairs
    s = words(b, 96, 108, torch.int32)  # (n, 3)
    low = split_nibbles(s[:, :2])  # (n, 2, 2): scales 0-3, 4-7, 8-11, 12-15
    high = planes(s[:, 2:], 2, 3, lshift=4)  # (n, 4, 1)
    sc = bytes_of(low.reshape(n, 4) | high.reshape(n, 4), n, 16, dtype=torch.int8) - 32
    dl = (f16(b, 108) * sc).unsqueeze(-1)  # (n, 16, 1)
    ql = planes(words(b, 32, 96).view(n, 2, 4), 2, 3)  # (n, 2, 4, 4) words
    qh = planes(words(b, 0, 32), 1, 1, lshift=2)  # (n, 8, 4) words
    # a set hmask bit means "no -4 offset": ql - 4 * (1 - h) == (ql | h << 2) - 4
    q = bytes_of(ql.view(n, 32) | qh.view(n, 32), n, 16, 16, dtype=torch.int8) - 4
    return q.float().mul_(dl).view(n, 256)


def _k4_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K header -> per-32 (n, 8, 1) scales d * sc and mins dmin * m.

    Bytes 4..16 hold eight 6-bit scales and eight 6-bit mins (ggml's get_scale_min_k4): three
    uint32 words (low scales, low mins, high nibbles), unpacked here for scales and mins at once.
    """
    n = b.shape[0]
    w = columns(b, 4, 16)  # (3, n)
    low = w[:2]  # (2, n): scales word, mins word
    high = w[2:] >> shifts((0, 4), (2, 1), b.device, torch.int32)  # (2, n)
    lo = low & 0x3F3F3F3F
    hi = (high & 0x0F0F0F0F) | ((low >> 2) & 0x30303030)
    six = torch.stack((lo, hi), dim=-1).view(torch.uint8).view(2, n, 8)
    s = six.float().mul_(f16(b, 0, 2).t().unsqueeze(-1))  # (2, n, 8): d * sc, dmin * m
    return _columns(s)


def _columns(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(2, n, k) scales and mins -> two contiguous (n, k, 1).

    NOTE: contiguous matters: a strided (n, k, 1) operand doubles the time of the
    (n, k, 32) multiply it is broadcast into."""
    s = s.contiguous()
    return s[0].unsqueeze(-1), s[1].unsqueeze(-1)


def q4_k(b: torch.Tensor) -> torch.Tensor:
    """d, dmin: f16, scales: 12 bytes, qs: 128 bytes of 4-bit codes (32 bytes per 64 values)."""
    n = b.shape[0]
    dl, ml = _k4_scales(b)
    q = split_nibbles(words(b, 16, 144).view(n, 4, 4))  # (n, 4, 2, 4) words: (n, 8, 32) bytes
    return bytes_of(q, n, 8, 32).float().mul_(dl).sub_(ml).view(n, 256)


def q5_k(b: torch.Tensor) -> torch.Tensor:
    """d, dmin: f16, scales: 12 bytes, qh: 32 bytes of fifth bits, qs: 128 bytes of low 4."""
    n = b.shape[0]
    dl, ml = _k4_scales(b)
    ql = split_nibbles(words(b, 48, 176).view(n, 4, 4))  # (n, 4, 2, 4) words
    qh = planes(words(b, 16, 48), 1, 1, lshift=4)  # (n, 8, 4) words
    q = bytes_of(ql.view(n, 32) | qh.view(n, 32), n, 8, 32)
    return q.float().mul_(dl).sub_(ml).view(n, 256)


def q6_k(b: torch.Tensor) -> torch.Tensor:
    """ql: 128 bytes of low 4 bits, qh: 64 bytes of high 2 bits, scales: 16 int8, d: f16."""
    n = b.shape[0]
    dl = b[:, 192:208].view(torch.int8).float().mul_(f16(b, 208)).unsqueeze(-1)  # (n, 16, 1)
    ql = split_nibbles(words(b, 0, 128).view(n, 2, 8))  # (n, 2, 2, 8) words
    qh = planes(words(b, 128, 192).view(n, 2, 4), 2, 3, lshift=4)  # (n, 2, 4, 4) words
    q = bytes_of(ql.view(n, 32) | qh.view(n, 32), n, 16, 16, dtype=torch.int8) - 32
    return q.float().mul_(dl).view(n, 256)


def iq4_xs(b: torch.Tensor) -> torch.Tensor:
    """d: f16, scales_h: uint16 of 2-bit highs, scales_l: 4 bytes of 4-bit lows (offset 32),
    qs: 128 bytes of 4-bit indices into IQ4_NL's table."""
    n = b.shape[0]
    low = nibbles(b[:, 4:8]).transpose(1, 2).reshape(n, 8)
    high = bit_planes(b[:, 2:4], 2, 3, dim=-1).reshape(n, 8)
    sc = (low | (high << 4)).view(torch.int8) - 32
    dl = (f16(b, 0) * sc).unsqueeze(-1)  # (n, 8, 1)
    v = nibble_values(words(b, 8, 136).view(n, 8, 2), quants.IQ4_NL.kvalues, "iq4nl")
    return v.view(n, 8, 32).mul_(dl).view(n, 256)  # (n, 8, 2, 16) values, scaled


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
    return t.float().mul_(f16(b, 52))


def tq2_0(b: torch.Tensor) -> torch.Tensor:
    """qs: 64 bytes of 2-bit codes (value - 1), d: f16 (at byte 64)."""
    n = b.shape[0]
    q = planes(words(b, 0, 64).view(n, 2, 4), 2, 3)  # (n, 2, 4, 4) words
    return (bytes_of(q, n, 256, dtype=torch.int8) - 1).float().mul_(f16(b, 64))


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
