"""LFM2's short convolution: a gated, causal, depthwise convolution over a few tokens.

A layer projects its input to three streams b, c, x (`shortconv.in_proj`), convolves b * x
along time with a kernel of L taps per channel (`shortconv.conv`), gates the result with c and
projects it back (`shortconv.out_proj`), as llama.cpp's lfm2 graph does. The state carried
between calls is the last L - 1 values of b * x (B, L - 1, n_embd), float32.
"""

from __future__ import annotations

import torch


def causal_conv(
    u: torch.Tensor, kernel: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """u (B, T, C) float32, kernel (C, L), state (B, L - 1, C) or None (zeros) ->
    (out (B, T, C) with out[t] = sum_k window[t + k] * kernel[:, k] over the state then u,
    the last L - 1 rows of that window: the next state).

    NOTE: the taps are summed in order k = 0, 1, ... as ggml's ssm_conv sums them, so float32
    results match it digit for digit."""
    B, T, C = u.shape
    L = kernel.shape[1]
    if state is None:
        state = u.new_zeros(B, L - 1, C)
    window = torch.cat((state.to(u.dtype), u), 1)  # (B, L - 1 + T, C)
    out = window[:, 0:T] * kernel[:, 0]
    for k in range(1, L):
        out = out + window[:, k : k + T] * kernel[:, k]
    return out, window[:, T:]


def mix(block, h: torch.Tensor, ctx) -> torch.Tensor:
    """The short-convolution mixer: h (B, T, n_embd) normed input -> (B, T, n_embd)."""
    conv = block.part("shortconv")
    b, c, x = conv.in_proj(h).float().chunk(3, dim=-1)
    bx = b * x
    if ctx.valid is not None:  # left padding leaves the state as it is: zeros
        bx = bx * ctx.valid[..., None]
    state = ctx.state(block.il)
    out, new_state = causal_conv(
        bx, block.part("shortconv.conv.weight"), None if state is None else state[0]
    )
    ctx.keep(block.il, (new_state,))
    return conv.out_proj((c * out).to(ctx.dtype))
