"""The 8-bit weight store: frozen weights as int8 rows with one scale per output channel.

`quantize_rows` turns dense float32 rows into (q, scale): q (n_out, n_in) int8 in [-127, 127],
scale (n_out,) with every scale a bf16 number, so each kernel (the weight-only int8 product,
a bf16 or float32 product over q) reads the same scale. W8 = q * scale[:, None] is the weight
the model computes with; it differs from the file's by at most scale / 2 an element.

`int8_linear` is x @ W8^T with a backward that never builds W8: the input gradient is
(g * scale) @ q, since W8 = diag(scale) q. Only q converted to the compute dtype exists while a
product runs (one weight at a time), never a copy of the whole model. Knows int8 rows and
scales; nothing about GGUF files or the cache that holds them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

QMAX = 127  # symmetric: -128 is never used, so q and -q are both representable
# Rows up to this many go through torch's weight-only int8 kernel (bf16 on the CPU): it reads
# 1 byte a weight and runs as fast as the dense bf16 product at 1-8 rows (a decode step), but
# about 3x slower at 512 rows; above it, q converted to bf16 (~8 ms for 16M weights) and one
# bf16 product (~80 ms at 512 rows, 2 cores with AVX512-BF16, a busy machine).
KERNEL_ROWS = 16


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (n_out, n_in) float32 -> q (n_out, n_in) int8, scale (n_out,) float32.

    scale is max|w_row| / 127 rounded up to a bf16 number (|w / scale| <= 127 still holds);
    a row of zeros gets scale 1 and q 0."""
    amax = w.abs().amax(dim=1)  # (n_out,)
    scale = _round_up_bf16(torch.where(amax > 0, amax / QMAX, torch.ones_like(amax)))
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def _round_up_bf16(x: torch.Tensor) -> torch.Tensor:
    """The smallest bf16 number >= x, as float32 (x positive and finite)."""
    down = x.to(torch.bfloat16).float()
    up = torch.nextafter(down.to(torch.bfloat16), torch.tensor(float("inf"), dtype=torch.bfloat16))
    return torch.where(down >= x, down, up.float())


def dequantized(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W8 = q * scale rows in `dtype` (a slice of q and scale gives those rows).

    Computed in `dtype` itself: q (7 bits) and scale (a bf16 number) are exact there, and
    their product, exact in float32 (15 significant bits), is rounded once either way."""
    return q.to(dtype) * scale.to(dtype)[:, None]


def int8_product(x2: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x2 (N, n_in) @ W8^T -> (N, n_out) in x2's dtype, without building W8."""
    if x2.dtype == torch.bfloat16 and x2.device.type == "cpu" and x2.shape[0] <= KERNEL_ROWS:
        return torch.ops.aten._weight_int8pack_mm(x2.contiguous(), q, scale.to(x2.dtype))
    return F.linear(x2, q.to(x2.dtype)) * scale.to(x2.dtype)


def int8_input_grad(g2: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """g2 (N, n_out) @ W8 -> (N, n_in): (g2 * scale) @ q, since W8 = diag(scale) q."""
    return (g2 * scale.to(g2.dtype)) @ q.to(g2.dtype)


class _Int8Linear(torch.autograd.Function):
    """y = x @ W8^T for a frozen W8 held as (q, scale); saves nothing of the weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.q, ctx.scale, ctx.dtype = q, scale, x.dtype  # the store's own tensors, not copies
        out = int8_product(x.reshape(-1, x.shape[-1]), q, scale)
        return out.view(*x.shape[:-1], q.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        g2 = grad.reshape(-1, grad.shape[-1]).to(ctx.dtype)
        dx = int8_input_grad(g2, ctx.q, ctx.scale)
        return dx.view(*grad.shape[:-1], ctx.q.shape[1]), None, None


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (..., n_in) -> (..., n_out) in x's dtype: x @ (q * scale)^T, forward and backward."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Int8Linear.apply(x, q, scale)
    out = int8_product(x.reshape(-1, x.shape[-1]), q, scale)
    return out.view(*x.shape[:-1], q.shape[0])
