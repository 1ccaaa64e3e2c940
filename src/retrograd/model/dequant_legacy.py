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

from retrograd.model.dequant_blocks import bit_planes, constant, f16, gather_rows, nibbles


def q4_0(b: torch.Tensor) -> torch.Tensor:
    """d: f16, qs: 16 bytes of 4-bit values (low nibbles are 0..15, high are 16..31)."""
    d = f16(b, 0)  # (n, 1)
    q = nibbles(b[:, 2:]).view(torch.int8).reshape(-1, 32) - 8  # (n, 32) in -8..7
    return q * d


def q4_1(b: torch.Tensor) -> torch.Tensor:
    """d: f16, m: f16, qs: 16 bytes of 4-bit values; x = d * q + m."""
    d, m = f16(b, 0), f16(b, 2)
    q = nibbles(b[:, 4:]).reshape(-1, 32)  # (n, 32) in 0..15
    return (q * d).add_(m)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """(n, 4) bytes of a little-endian uint32 -> (n, 32) bits, bit j of the word at j."""
    return bit_planes(qh, 1, 1, dim=-1).reshape(-1, 32)


def q5_0(b: torch.Tensor) -> torch.Tensor:
    """d: f16, qh: uint32 of fifth bits, qs: 16 bytes of low 4 bits."""
    d = f16(b, 0)
    q = nibbles(b[:, 6:]).reshape(-1, 32) | (_fifth_bits(b[:, 2:6]) << 4)  # (n, 32) in 0..31
    return (q.view(torch.int8) - 16) * d


def q5_1(b: torch.Tensor) -> torch.Tensor:
    """d: f16, m: f16, qh: uint32 of fifth bits, qs: 16 bytes of low 4 bits."""
    d, m = f16(b, 0), f16(b, 2)
    q = nibbles(b[:, 8:]).reshape(-1, 32) | (_fifth_bits(b[:, 4:8]) << 4)
    return (q * d).add_(m)


def q8_0(b: torch.Tensor) -> torch.Tensor:
    """d: f16, qs: 32 int8."""
    return b[:, 2:].view(torch.int8) * f16(b, 0)


def _iq4nl_values(device: torch.device) -> torch.Tensor:
    return constant(
        "iq4nl", device, lambda: np.array(quants.IQ4_NL.kvalues, dtype=np.float32).reshape(16, 1)
    )


def iq4_nl(b: torch.Tensor) -> torch.Tensor:
    """d: f16, qs: 16 bytes of 4-bit indices into a fixed non-linear table."""
    d = f16(b, 0)
    v = gather_rows(_iq4nl_values(b.device), nibbles(b[:, 2:]).reshape(-1, 32))  # (n, 32, 1)
    return d * v.reshape(-1, 32)


def _fp4_values(device: torch.device) -> torch.Tensor:
    # e2m1 values, doubled (the block scale is halved to match)
    return constant(
        "e2m1", device, lambda: np.array(quants.MXFP4.kvalues, dtype=np.float32).reshape(16, 1)
    )


def _e8m0_half(device: torch.device) -> torch.Tensor:
    # all 256 exponents through gguf-py's own decoder: exact by construction
    return constant(
        "e8m0_half",
        device,
        lambda: quants.MXFP4.e8m0_to_fp32_half(np.arange(256, dtype=np.uint8)).reshape(256, 1),
    )


def mxfp4(b: torch.Tensor) -> torch.Tensor:
    """e: e8m0 exponent byte, qs: 16 bytes of 4-bit e2m1 codes."""
    d = gather_rows(_e8m0_half(b.device), b[:, 0]).reshape(-1, 1)  # (n, 1)
    v = gather_rows(_fp4_values(b.device), nibbles(b[:, 1:]).reshape(-1, 32))
    return d * v.reshape(-1, 32)


def _ue4m3(device: torch.device) -> torch.Tensor:
    def build():
        values = quants.NVFP4.ue4m3_to_fp32(np.arange(256, dtype=np.uint8))
        return values.astype(np.float32).reshape(256, 1)

    return constant("ue4m3", device, build)


def nvfp4(b: torch.Tensor) -> torch.Tensor:
    """Four sub-blocks of 16: d: 4 ue4m3 bytes, qs: 4 x 8 bytes of 4-bit e2m1 codes."""
    d = gather_rows(_ue4m3(b.device), b[:, :4])  # (n, 4, 1)
    qs = b[:, 4:].reshape(-1, 4, 8)
    codes = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # (n, 4, 16)
    v = gather_rows(_fp4_values(b.device), codes).reshape(-1, 4, 16)
    return (d * v).reshape(-1, 64)


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
