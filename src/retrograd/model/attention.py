"""Attention, four ways: SDPA (float32, the exactness path, and other devices), chunked bf16
matmuls with a float32 softmax (16 bits on the CPU, with its own backward), one query a
sequence straight from the cache (the fast sampling context's decode step), and float32 with
soft-capped scores or sinks (gemma2, gpt-oss). `attention` picks among the first three.

Causal attention in 16 bits on the CPU: bf16 matmuls with a float32 softmax.

PyTorch's flash attention is slow on the CPU at Gemma 3's head size (256) and small batches:
its backward takes 9.4 ms a layer for 512 tokens, and one decode step with 8 sequences takes
1.3 ms a layer, against about 4.5 ms (forward and backward) and 0.1 ms here. `attention`
computes scores with one bf16 matmul per key/value head (rounded to bf16, as transformers'
eager attention does under autocast), the masked softmax in float32 (fused), and the output
with a second matmul, a query chunk at a time so that nothing of size T x S outlives a chunk
and each chunk skips the keys after its last query. Backward recomputes the probabilities
from the stored log-sum-exp. Training, evaluation and sampling share this path, so a sampled
token's log-probability is what training computes; float32 (the exactness path) and other
devices keep `F.scaled_dot_product_attention`.

Grouped queries are handled without expanding keys and values: the g query heads that share
a key/value head are stacked into one (g * T, D) matrix, so each product is one matmul and the
key/value gradients come out already summed over the group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from retrograd.compiled import fused

QUERY_CHUNK = 128  # query rows per chunk: bounds the (rows x keys) temporaries; a chunk skips
# the keys after its last query (causal), 3/8 of the work at 512 tokens (128: measured best)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    fast: bool = False,
) -> torch.Tensor:
    """q (B, H, T, D), k and v (B, H_kv, S, D), mask (T, S) or (B, 1, T, S) bool (True = may
    attend) or None for causal -> (B, H, T, D). Differentiable in q, k and v.

    fast (the compute plan's `fast_decode`, the fast sampling context): one query a sequence
    runs as one fused kernel in float32 straight from the KV cache, no copies of the cache's
    strided rows, three times faster with 8 sequences. Its scores are float32 where the matmul
    path rounds them to bf16, so the exact sampling context (training's numbers) leaves it off."""
    if q.device.type != "cpu" or q.dtype == torch.float32:
        # NOTE: float32 (the exactness path) keeps PyTorch's own kernels as the reference.
        H = q.shape[1]
        k, v = repeat_kv(k, H), repeat_kv(v, H)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and q.shape[2] > 1, scale=scale
        )
    if mask is None:
        T, S = q.shape[2], k.shape[2]
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if needs_grad:
        return _Attention.apply(q, k, v, mask, scale)
    if q.shape[2] == 1 and fast:
        return _decode_step(q, k, v, mask, scale)
    return _forward(q, k, v, mask, scale)[0]


def last_query_mask(mask: torch.Tensor, B: int) -> torch.Tensor:
    """The last query's row of a (T, S) or (B, 1, T, S) mask as (B, S): a decode step's."""
    m = mask[..., -1, :]  # (S,) or (B, 1, S)
    S = m.shape[-1]
    return m.expand(B, S) if m.dim() == 1 else m.reshape(B, S)


def _decode_step(q, k, v, mask, scale) -> torch.Tensor:
    """q (B, H, 1, D) against k, v (B, H_kv, S, D) -> (B, H, 1, D)."""
    B, H, _, D = q.shape
    H_kv = k.shape[1]
    m = last_query_mask(mask, B)
    o = _one_token(q.reshape(B, H_kv, H // H_kv, D), k, v, m, scale)
    return o.view(B, H, 1, v.shape[-1])


def one_token_attention(q, k, v, mask, scale: float = 1.0) -> torch.Tensor:
    """One query per sequence: q (B, H_kv, g, D), k (B, H_kv, S, D), v (B, H_kv, S, Dv), mask
    (B, S) -> (B, H_kv, g, Dv) in q's dtype, in float32 straight from the cache's rows. The
    decode step's attention, eager (`_one_token`) and inside the decode graph (model/decode.py)."""
    s = (q.float()[:, :, :, None, :] * k.float()[:, :, None]).sum(-1)  # (B, H_kv, g, S)
    if scale != 1.0:
        s = s * scale
    s = torch.where(mask[:, None, None, :], s, float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    # NOTE: summing over the keys as an outer dimension (the values' rows) and normalizing
    # after measured ~20 us a layer faster than softmax, then a sum over the inner dimension
    o = (e.permute(0, 1, 3, 2)[..., None] * v.float()[:, :, :, None, :]).sum(2)  # (B,H_kv,g,Dv)
    return (o / e.sum(-1)[..., None]).to(q.dtype)


_one_token = fused(dynamic={0: (0,), 1: (0, 2), 2: (0, 2), 3: (0, 1)})(one_token_attention)


def capped_attention(q, k, v, mask, cap: float = 0.0, sinks=None) -> torch.Tensor:
    """Attention in float32 with what SDPA has no hook for: tanh soft-capped scores (gemma2),
    and sinks (gpt-oss, (H,)): one logit per head that joins every softmax and is dropped
    after it, so that a query's weights on the keys sum to less than one."""
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    scores = q.float() @ k.float().transpose(-1, -2)  # (B, H, T, S)
    if cap:
        scores = torch.tanh(scores / cap) * cap
    B, H, T, S = scores.shape
    if mask is None:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, H, 1, 1).expand(B, H, T, 1)
        probs = torch.cat([scores, sink], -1).softmax(-1)[..., :S]
        return (probs @ v.float()).to(q.dtype)
    return (scores.softmax(-1) @ v.float()).to(q.dtype)


def _forward(q, k, v, mask, scale, keep: list | None = None):
    """-> output (B, H, T, D), log-sum-exp of the scaled scores (B, H, T) float32. keep: a
    list that receives each chunk's probabilities (for backward)."""
    B, H, T, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    for t0, t1, s1, grouped, m in _chunks(q, mask, k.shape[1]):
        n = t1 - t0
        s16 = grouped(q) @ k[:, :, :s1].transpose(-1, -2)  # (B, H_kv, g n, s1)
        p16, lse_g = _softmax(s16.view(-1, s1), m, scale)  # (rows, s1), (rows,)
        o[:, :, t0:t1] = (p16.view(s16.shape) @ v[:, :, :s1]).view(B, H, n, D)
        lse[:, :, t0:t1] = lse_g.view(B, H, n)
        if keep is not None:
            keep.append(p16)
    return o, lse


KEEP_PROBS = 1 << 22  # probabilities per layer kept for backward (8 MiB in bf16), else recomputed


def repeat_kv(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """(B, H_kv, S, D) -> (B, H, S, D): query head h reads key/value head h // (H / H_kv).

    NOTE: SDPA's own enable_gqa path runs its bf16 backward about 3x slower on CPU than on
    expanded heads (a view when H_kv = 1).
    """
    B, H_kv, S, D = t.shape
    if H_kv == n_head:
        return t
    return t[:, :, None].expand(B, H_kv, n_head // H_kv, S, D).reshape(B, n_head, S, D)


@fused(dynamic={0: (0, 1), 1: (0, 1)})
def _softmax(s16: torch.Tensor, mask: torch.Tensor, scale: float):
    """Masked softmax of scale * s in float32 -> (probabilities in the compute dtype, lse)."""
    z = torch.where(mask, s16.float() * scale, float("-inf"))
    lse = torch.logsumexp(z, -1)
    return torch.exp(z - lse[:, None]).to(s16.dtype), lse


@fused(dynamic={0: (0, 1), 1: (0,), 2: (0, 1)})
def _probs(s16: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor, scale: float):
    """exp(scale * s - lse) where the mask allows, 0 elsewhere -> the compute dtype."""
    p = torch.exp(s16.float() * scale - lse[:, None])
    return torch.where(mask, p, 0.0).to(s16.dtype)


@fused(dynamic={0: (0, 1), 1: (0, 1), 2: (0,)})
def _score_grad(p16: torch.Tensor, dp16: torch.Tensor, delta: torch.Tensor, scale: float):
    """dL/ds = scale * p * (dp - delta) -> the compute dtype."""
    return (p16.float() * (dp16.float() - delta[:, None]) * scale).to(p16.dtype)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        B, H, T, _ = q.shape
        keep = [] if B * H * T * k.shape[2] <= KEEP_PROBS else None
        o, lse = _forward(q, k, v, mask, scale, keep)
        ctx.save_for_backward(q, k, v, mask, o, lse, *(keep or []))
        ctx.scale, ctx.kept = scale, keep is not None
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, mask, o, lse, *kept = ctx.saved_tensors
        scale = ctx.scale
        B, H, T, D = q.shape
        H_kv = k.shape[1]
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        do = do.to(q.dtype)
        delta = (do.float() * o.float()).sum(-1)  # (B, H, T)
        for i, (t0, t1, s1, grouped, m) in enumerate(_chunks(q, mask, H_kv)):
            kc, vc = k[:, :, :s1], v[:, :, :s1]  # the keys these queries may see
            qg, dog = grouped(q), grouped(do)  # (B, H_kv, g n, D)
            lse_g, delta_g = grouped(lse).reshape(-1), grouped(delta).reshape(-1)  # (rows,)
            shape = (*qg.shape[:-1], s1)  # (B, H_kv, g n, s1)
            if kept:
                p16 = kept[i]  # (rows, s1)
            else:
                p16 = _probs((qg @ kc.transpose(-1, -2)).view(-1, s1), lse_g, m, scale)
            dv[:, :, :s1] += (p16.view(shape).transpose(-1, -2) @ dog).float()
            dp16 = (dog @ vc.transpose(-1, -2)).view(-1, s1)
            ds16 = _score_grad(p16, dp16, delta_g, scale).view(shape)
            dq[:, :, t0:t1] = (ds16 @ kc).view(B, H, t1 - t0, D)
            dk[:, :, :s1] += (ds16.transpose(-1, -2) @ qg).float()
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None


def _chunks(q: torch.Tensor, mask: torch.Tensor, H_kv: int):
    """Query chunks (t0, t1, s1, grouped, mask rows): queries [t0, t1) see keys [0, s1) (the
    mask is causal: query t sits at position S - T + t, so later keys are never visible);
    grouped(x) turns (B, H, T, ...) rows [t0, t1) into (B, H_kv, g * n, ...); the mask is
    (B * H_kv * g * n, s1), a row per score row. NOTE: the fused kernels see 2-D scores and
    masks whatever B, H and the mask's own shape, so each compiles for few shapes."""
    B, H, T, _ = q.shape
    g = H // H_kv
    S = mask.shape[-1]
    for t0 in range(0, T, QUERY_CHUNK):
        t1 = min(t0 + QUERY_CHUNK, T)
        n = t1 - t0

        def grouped(x: torch.Tensor, t0=t0, t1=t1, n=n) -> torch.Tensor:
            x = x[:, :, t0:t1]
            return x.reshape(B, H_kv, g * n, *x.shape[3:])

        s1 = min(S, S - T + t1)
        m = mask[..., t0:t1, :s1]  # (n, s1) or (B, 1, n, s1)
        m = m.expand(B * H, n, s1) if m.dim() == 2 else m.expand(B, H, n, s1)
        m = m.reshape(-1, s1)
        yield t0, t1, s1, grouped, m
