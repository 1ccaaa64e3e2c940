"""Frozen products and their LoRA adapters as one autograd function, in 16-bit compute.

For linears that share an input x (q, k, v; gate, up; or one alone) with adapters (A_i, B_i,
scale s_i): y_i = x W_i^T + s_i (x A_i^T) B_i^T, computed as one product over the weights
stacked by rows (the dense cache's stacked copy; a single weight's own dense copy), one
product x [A_1; A_2; ...]^T for every adapter's first factor, and each adapter's second
factor added into its columns of y in place (`addmm_`). Backward the same way: the input
gradient is one product over the stacked weights with the adapters' part added in place
(one product over the stacked A's), the A gradients come from one product. Against a
frozen product plus an `add_lora` per linear under autograd this saves a copy of every
output (addmm's result is a new tensor), an addition of the input gradients per adapter,
and five small products in seven. The sums are the same products rounded to the compute
type once each (the input gradient's parts are added before rounding, where autograd adds
rounded ones), so numbers agree within bf16 rounding, not bit for bit; float32 (the
exactness path) never comes here.

Knows frozen weights and the adapters' tensors; nothing about LoRA modules or training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from retrograd.model.frozen import FrozenTensor


def fusable(x: torch.Tensor, weights: list[FrozenTensor]) -> bool:
    """Whether products of x with these frozen weights and their adapters run as one
    function: 16-bit compute with autograd recording, dense weights (no 8-bit store), and,
    for more than one weight, the cache on (the stacked copy lives there)."""
    if x.dtype == torch.float32 or not torch.is_grad_enabled():
        return False
    if any(w.in_int8 for w in weights):
        return False
    return len(weights) == 1 or weights[0].cache.enabled


def frozen_lora(
    x: torch.Tensor,
    weights: list[FrozenTensor],
    adapters: list[tuple[torch.Tensor, torch.Tensor, float]],
) -> list[torch.Tensor]:
    """[x W_i^T + s_i (x A_i^T) B_i^T] in x's dtype; adapters (A_i (r, n_in), B_i (n_out, r),
    s_i) as `Linear.adapter` gives them."""
    a = [t for t, _, _ in adapters]
    b = [t for _, t, _ in adapters]
    scales = [s for _, _, s in adapters]
    y = _FrozenLoRA.apply(x, weights, scales, *a, *b)
    return list(y.split([w.shape[0] for w in weights], -1))


def _dense(weights: list[FrozenTensor], dtype: torch.dtype) -> torch.Tensor:
    if len(weights) == 1:
        return weights[0].dense(dtype)
    return weights[0].cache.stacked(weights, dtype)


def _columns(sizes: list[int]) -> list[slice]:
    out, start = [], 0
    for n in sizes:
        out.append(slice(start, start + n))
        start += n
    return out


class _FrozenLoRA(torch.autograd.Function):
    """y = x [W_1; W_2; ...]^T + [s_1 x A_1^T B_1^T, ...] with the frozen W never saved."""

    @staticmethod
    def forward(ctx, x, weights, scales, *ab):
        n = len(weights)
        a, b = ab[:n], ab[n:]
        dtype = x.dtype
        x2 = x.reshape(-1, x.shape[-1])
        y = F.linear(x2, _dense(weights, dtype))  # (N, sum of n_out)
        a16 = torch.cat([t.to(dtype) for t in a]) if n > 1 else a[0].to(dtype)  # (sum r, n_in)
        xa = x2 @ a16.T  # (N, sum r)
        sb = [(t * s).to(dtype) for t, s in zip(b, scales, strict=True)]  # (n_out, r) each
        cols, ranks = _columns([w.shape[0] for w in weights]), _columns([t.shape[0] for t in a])
        for c, r, t in zip(cols, ranks, sb, strict=True):
            y[:, c].addmm_(xa[:, r], t.T)
        ctx.weights, ctx.scales, ctx.cols, ctx.ranks = weights, scales, cols, ranks
        ctx.shape, ctx.dtypes = x.shape, [t.dtype for t in a]
        ctx.save_for_backward(x2, xa, a16, *sb)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x2, xa, a16, *sb = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(x2.dtype)  # (N, sum of n_out)
        gxa = torch.cat([g[:, c] @ t for c, t in zip(ctx.cols, sb, strict=True)], -1)
        gx = None
        if ctx.needs_input_grad[0]:
            gx = g @ _dense(ctx.weights, x2.dtype)  # dense again: nothing was kept
            gx.addmm_(gxa, a16)
            gx = gx.view(ctx.shape)
        ga = (gxa.T @ x2).split([r.stop - r.start for r in ctx.ranks])  # (r, n_in) each
        ga = [t.to(d) for t, d in zip(ga, ctx.dtypes, strict=True)]
        gb = [
            (g[:, c].T @ xa[:, r]).to(ctx.dtypes[i]) * ctx.scales[i]
            for i, (c, r) in enumerate(zip(ctx.cols, ctx.ranks, strict=True))
        ]
        return gx, None, None, *ga, *gb
