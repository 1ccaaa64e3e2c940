"""Cross-entropy over a large vocabulary without materializing (tokens, vocab) logits.

`token_nll_sum` returns the summed negative log-likelihood of the target tokens. The plain
path computes the masked positions' logits at once. The chunked path walks the positions in
chunks of `seq_chunk` and the vocabulary in `tiles`: a custom autograd function keeps only
the hidden states and a log-sum-exp per position and recomputes each tile's logits in
backward (Gemma's 262k-wide head would otherwise need 1 MiB of float32 per token, twice).
A head with trainable parts (a LoRA on `output`, a bias) takes a checkpointed chunk path so
its parameters still get gradients. Both equal the plain path (tests/unit/losses).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from retrograd.model.decoder import Decoder
from retrograd.model.frozen import FrozenTensor


def token_nll_sum(
    decoder: Decoder,
    h: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunked: bool = True,
    tiles: int = 8,
    seq_chunk: int = 512,
) -> torch.Tensor:
    """h (N, n_embd) hidden states of the positions to score, targets (N,) -> scalar float32."""
    if h.shape[0] == 0:
        return h.sum() * 0.0
    if not chunked:
        return F.cross_entropy(decoder.head(h), targets, reduction="sum")
    step = seq_chunk if seq_chunk > 0 else h.shape[0]
    frozen = _frozen_head(decoder)
    total = h.new_zeros((), dtype=torch.float32)
    for s in range(0, h.shape[0], step):
        hc, tc = h[s : s + step], targets[s : s + step]
        if frozen is not None:
            total = total + _TiledHeadCE.apply(
                hc, tc, frozen, decoder.compute_dtype, tiles, decoder.cfg.final_softcap
            )
        else:
            total = total + checkpoint(_plain_sum, decoder, hc, tc, use_reentrant=False)
    return total


def _plain_sum(decoder: Decoder, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(decoder.head(h), targets, reduction="sum")


def _frozen_head(decoder: Decoder) -> FrozenTensor | None:
    """The head's weight when nothing in the head trains, else None."""
    out = decoder.output
    if out is None:
        return decoder.token_embd
    if out.lora is None and out.bias is None:
        return out.frozen
    return None


def _tile_logits(h: torch.Tensor, w: torch.Tensor, cap: float) -> torch.Tensor:
    z = (h @ w.T).float()  # (N, tile)
    return torch.tanh(z / cap) * cap if cap else z


class _TiledHeadCE(torch.autograd.Function):
    """sum_i -log softmax(h_i W^T)[t_i], over vocabulary tiles, for a frozen W.

    When h needs a gradient, forward also accumulates it: with an online softmax (running
    max m, running sum s), acc = sum_tiles exp(z - m) @ W is rescaled whenever m grows, and
    dL/dh = acc / s - W[t] at the end. Each tile's logits are computed once (a fused
    linear-cross-entropy); backward only scales the stored gradient.
    """

    @staticmethod
    def forward(ctx, h, targets, weight: FrozenTensor, dtype, tiles: int, cap: float):
        want_grad = ctx.needs_input_grad[0]
        hd = h.detach().to(dtype)
        N, n_vocab = h.shape[0], weight.shape[0]
        width = -(-n_vocab // tiles)
        m = torch.full((N,), float("-inf"), device=h.device)  # running max
        s = torch.zeros(N, device=h.device)  # running sum of exp(z - m)
        acc = torch.zeros(N, h.shape[1], device=h.device) if want_grad else None  # (N, n_embd)
        target_logit = torch.zeros(N, device=h.device)
        target_grad = torch.zeros(N, h.shape[1], device=h.device) if want_grad else None
        for v0 in range(0, n_vocab, width):
            w = weight.row_block(v0, min(v0 + width, n_vocab), dtype)  # (tile, n_embd)
            z = _tile_logits(hd, w, cap)  # (N, tile) float32
            inside = (targets >= v0) & (targets < v0 + z.shape[1])
            idx = (targets - v0).clamp(0, z.shape[1] - 1)
            target_logit += torch.where(inside, z.gather(1, idx[:, None])[:, 0], 0.0)
            dcap = 1 - (z / cap) ** 2 if cap else None  # d(cap tanh(x / cap))/dx
            new_m = torch.maximum(m, z.max(-1).values)
            scale = torch.exp(m - new_m)  # (N,)
            # NOTE: in place: a tile is (tokens x vocab / tiles) floats, the largest tensors here
            e = z.sub_(new_m[:, None]).exp_()  # (N, tile)
            s = s * scale + e.sum(-1)
            m = new_m
            if want_grad:
                rows = inside.nonzero()[:, 0]
                if cap:
                    target_grad[rows] += dcap[rows, idx[rows], None] * w[idx[rows]].float()
                    e.mul_(dcap)
                else:
                    target_grad[rows] += w[idx[rows]].float()
                acc = acc * scale[:, None] + (e.to(dtype) @ w).float()
        lse = m + torch.log(s)  # (N,)
        if want_grad:
            ctx.save_for_backward(acc / s[:, None] - target_grad)
        return (lse - target_logit).sum()

    @staticmethod
    def backward(ctx, grad_out):
        (grad_h,) = ctx.saved_tensors
        return grad_h * grad_out, None, None, None, None, None
