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

from retrograd.compiled import fused
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
    head_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """h (N, n_embd) hidden states of the positions to score, targets (N,) -> scalar float32.

    head_dtype: the dtype of the frozen head's tiles (default: the decoder's compute dtype;
    bench/loss_precision.py measures bf16 tiles against float32 ones, docs/exactness.md)."""
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
                hc,
                tc,
                frozen,
                head_dtype or decoder.compute_dtype,
                tiles,
                decoder.cfg.final_softcap,
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


TILE_ROWS = 4096  # the widest tile walked at once: its logits stay in cache (measured best)
ROW_ALIGN = 16  # 16-bit: positions padded to a multiple; oneDNN's bf16 products run ~10%
# slower on 511 rows than on 512 (a window of 512 ids scores 511 positions)


@fused(dynamic={0: (0,), 1: (0,), 2: (0,)})  # rows vary; a tile's width is a constant
def _tile_softmax(z16: torch.Tensor, m: torch.Tensor, s: torch.Tensor, cap: float, grad: bool):
    """One tile of the online softmax, fused: z16 (N, tile) logits in the compute dtype.

    -> (exp(z - new_m) in z16's dtype, times the soft-cap's derivative; None without grad),
    new running max, new running sum, and exp(m - new_m) to rescale what came before.
    """
    z = z16.float()
    if cap:
        z = torch.tanh(z / cap) * cap
    new_m = torch.maximum(m, z.amax(-1))
    scale = torch.exp(m - new_m)
    e = torch.exp(z - new_m[:, None])
    s = s * scale + e.sum(-1)
    if not grad:
        return None, new_m, s, scale
    if cap:
        e = e * (1 - (z / cap) ** 2)  # d(cap tanh(x / cap))/dx
    return e.to(z16.dtype), new_m, s, scale


class _TiledHeadCE(torch.autograd.Function):
    """sum_i -log softmax(h_i W^T)[t_i], over vocabulary tiles, for a frozen W.

    When h needs a gradient, forward also accumulates it: with an online softmax (running
    max m, running sum s), acc = sum_tiles exp(z - m) @ W is rescaled whenever m grows, and
    dL/dh = acc / s - W[t] at the end. Each tile's logits are computed once (a fused
    linear-cross-entropy); backward only scales the stored gradient. `tiles` bounds a tile's
    memory; tiles wider than TILE_ROWS are walked TILE_ROWS at a time, which keeps each
    tile's logits in cache between the matmul and the fused softmax (about 1.7x faster on a
    262k vocabulary than 8 wide tiles).
    """

    @staticmethod
    def forward(ctx, h, targets, weight: FrozenTensor, dtype, tiles: int, cap: float):
        want_grad = ctx.needs_input_grad[0]
        hd = h.detach().to(dtype)
        n_real, pad = h.shape[0], -h.shape[0] % ROW_ALIGN
        if pad and dtype != torch.float32:  # zero rows: logits 0, finite, dropped at the end
            hd, targets = F.pad(hd, (0, 0, 0, pad)), F.pad(targets, (0, pad))
        N, n_vocab = hd.shape[0], weight.shape[0]
        width = min(-(-n_vocab // tiles), TILE_ROWS)
        m = torch.full((N,), float("-inf"), device=h.device)  # running max
        s = torch.zeros(N, device=h.device)  # running sum of exp(z - m)
        acc = torch.zeros(N, h.shape[1], device=h.device) if want_grad else None  # (N, n_embd)
        target_logit = torch.zeros(N, device=h.device)
        target_grad = torch.zeros(N, h.shape[1], device=h.device) if want_grad else None
        for v0 in range(0, n_vocab, width):
            w = weight.row_block(v0, min(v0 + width, n_vocab), dtype)  # (tile, n_embd)
            z16 = hd @ w.T  # (N, tile) in the compute dtype
            inside = (targets >= v0) & (targets < v0 + z16.shape[1])
            idx = (targets - v0).clamp(0, z16.shape[1] - 1)
            zt = z16.gather(1, idx[:, None])[:, 0].float()  # the target's logit, if inside
            if cap:
                zt = torch.tanh(zt / cap) * cap
            target_logit += torch.where(inside, zt, 0.0)
            e, m, s, scale = _tile_softmax(z16, m, s, cap, want_grad)
            if want_grad:
                rows = inside.nonzero()[:, 0]
                if rows.numel():
                    w_t = w[idx[rows]].float()
                    if cap:
                        w_t *= (1 - (zt[rows] / cap) ** 2)[:, None]
                    target_grad[rows] += w_t
                acc = acc * scale[:, None] + (e @ w).float()
        lse = m + torch.log(s)  # (N,)
        if want_grad:
            ctx.save_for_backward((acc / s[:, None] - target_grad)[:n_real])
        return (lse - target_logit)[:n_real].sum()

    @staticmethod
    def backward(ctx, grad_out):
        (grad_h,) = ctx.saved_tensors
        return grad_h * grad_out, None, None, None, None, None
