"""Kernels for the small-block ggml types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4, NVFP4.

Each takes (n_blocks, type_size) uint8 and returns (n_blocks, block_size) float32, equal bit
for bit to gguf-py's `dequantize_blocks` of the same type. Layouts are ggml's (ggml-common.h);
the comment on each kernel gives its block.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from retrograd.model.dequant_blocks import (
    bytes_of,
    constant,
    f16,
    gather_rows,
    nibble_values,
    split_nibbles,
    words,
)


def _low4(b: torch.Tensor, start: int) -> torch.Tensor:
    """16 bytes of 4-bit codes from `start` -> (n, 4) int64 words of 32 code bytes, in
    ggml's order (low nibbles are values 0..15, high nibbles 16..31)."""
    return split_nibbles(words(b, start, start + 16)).reshape(-1, 4)


def _fifth_bits(b: torch.Tensor, start: int) -> torch.Tensor:
    """The uint32 of fifth bits at `start` -> (n, 4) int64 words of 32 bytes, each 0 or 16."""
    table = constant("bit4_bytes", b.device, _bit4_bytes)
    return gather_rows(table, b[:, start : start + 4]).reshape(-1, 4)


def _bit4_bytes() -> np.ndarray:
    """(256,) int64: byte j of entry v is bit j of v, moved to bit 4."""
    bits = (np.arange(256, dtype=np.uint8)[:, None] >> np.arange(8, dtype=np.uint8)) & 1
    return np.ascontiguousarray(bits << 4).view(np.int64).reshape(256)


def q4_0(b: torch.Tensor) -> torch.Tensor:
    """d: f16, qs: 16 bytes of 4-bit values; x = d * (q - 8)."""
    n = b.shape[0]
    q = bytes_of(_low4(b, 2), n, 32, dtype=torch.int8) - 8
    return q.float().mul_(f16(b, 0))


def q4_1(b: torch.Tensor) -> torch.Tensor:
    """d: f16, m: f16, qs: 16 bytes of 4-bit values; x = d * q + m."""
    n = b.shape[0]
    q = bytes_of(_low4(b, 4), n, 32)
    return q.float().mul_(f16(b, 0)).add_(f16(b, 2))


def q5_0(b: torch.Tensor) -> torch.Tensor:
    """d: f16, qh: uint32 of fifth bits, qs: 16 bytes of low 4 bits; x = d * (q - 16)."""
    n = b.shape[0]
    q = bytes_of(_low4(b, 6) | _fifth_bits(b, 2), n, 32, dtype=torch.int8) - 16
    return q.float().mul_(f16(b, 0))


def q5_1(b: torch.Tensor) -> torch.Tensor:
    """d: f16, m: f16, qh: uint32 of fifth bits, qs: 16 bytes of low 4 bits; x = d * q + m."""
    n = b.shape[0]
    q = bytes_of(_low4(b, 8) | _fifth_bits(b, 4), n, 32)
    return q.float().mul_(f16(b, 0)).add_(f16(b, 2))


def q8_0(b: torch.Tensor) -> torch.Tensor:
    """d: f16, qs: 32 int8."""
    return b[:, 2:].view(torch.int8).float().mul_(f16(b, 0))


def iq4_nl(b: torch.Tensor) -> torch.Tensor:
    """d: f16, qs: 16 bytes of 4-bit indices into a fixed non-linear table."""
    v = nibble_values(words(b, 2, 18), quants.IQ4_NL.kvalues, "iq4nl")  # (n, 2, 16)
    return v.view(-1, 32).mul_(f16(b, 0))


# e2m1 values, doubled (the block scale is halved to match)
_E2M1 = quants.MXFP4.kvalues


def _e8m0_half(device: torch.device) -> torch.Tensor:
    # all 256 exponents through gguf-py's own decoder: exact by construction
    return constant(
        "e8m0_half", device, lambda: quants.MXFP4.e8m0_to_fp32_half(np.arange(256, dtype=np.uint8))
    )


def mxfp4(b: torch.Tensor) -> torch.Tensor:
    """e: e8m0 exponent byte, qs: 16 bytes of 4-bit e2m1 codes."""
    n = b.shape[0]
    d = gather_rows(_e8m0_half(b.device), b[:, 0]).reshape(n, 1)
    return nibble_values(words(b, 1, 17), _E2M1, "e2m1").view(n, 32).mul_(d)


def _ue4m3(device: torch.device) -> torch.Tensor:
    def build():
        return quants.NVFP4.ue4m3_to_fp32(np.arange(256, dtype=np.uint8)).astype(np.float32)

    return constant("ue4m3", device, build)


def nvfp4(b: torch.Tensor) -> torch.Tensor:
    """Four sub-blocks of 16: d: 4 ue4m3 bytes, qs: 4 x 8 bytes of 4-bit e2m1 codes."""
    n = b.shape[0]
    d = gather_rows(_ue4m3(b.device), b[:, :4]).reshape(n, 4, 1)
    v = nibble_values(words(b, 4, 36).view(n, 4, 1), _E2M1, "e2m1")  # (n, 4, 2, 8)
    return v.view(n, 4, 16).mul_(d).view(n, 64)


KERNELS = {
    T.Q4_0: q4_0,
    T.Q4_1: q4_1,
    T.Q5_0: q5_0,
    T.Q5_1: q5_1,
    T.Q8_0: q8_0,
    T.IQ4_NL: iq4_nl,
    T.MXFP4: mxfp4,
    T.NVFP4: nvfp4,
}
