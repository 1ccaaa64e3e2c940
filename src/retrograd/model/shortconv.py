"""LFM2's short convolution: a gated, causal, depthwise convolution over a few tokens.

A layer projects its input to three streams b, c, x (`shortconv.in_proj`), convolves b * x
along time with a kernel of L taps per channel (`shortconv.conv`), gates the result with c and
projects it back (`shortconv.out_proj`), as llama.cpp's lfm2 graph does. The state carried
between calls is the last L - 1 values of b * x (B, L - 1, n_embd), float32.
"""

from __future__ import annotations

import torch

from retrograd.model.ssm import conv as causal_conv  # ggml's ssm_conv, as Mamba-2's


def mix(block, h: torch.Tensor, ctx) -> torch.Tensor:
    """The short-convolution mixer: h (B, T, n_embd) normed input -> (B, T, n_embd)."""
    layer = block.part("shortconv")
    b, c, x = layer.in_proj(h).float().chunk(3, dim=-1)
    bx = b * x
    if ctx.valid is not None:  # left padding leaves the state as it is: zeros
        bx = bx * ctx.valid[..., None]
    state = ctx.state(block.il)
    kernel = block.part("shortconv.conv.weight")
    out, new_state = causal_conv(bx, kernel, None, None if state is None else state[0])
    ctx.keep(block.il, (new_state,))
    return layer.out_proj((c * out).to(ctx.dtype))
