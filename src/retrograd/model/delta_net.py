"""The gated delta net (Qwen3.5, Qwen3-Next): a causal convolution and a delta-rule recurrence.

Math as llama.cpp computes it (src/models/qwen35.cpp, delta-net-base.cpp and ggml's
gated_delta_net op). Per layer, from the normed input h:
  qkv = silu(conv(attn_qkv(h))) with a causal depthwise kernel and a (d_conv - 1)-step state;
  q, k l2-normalized per head; v head j reads key head j % n_k_heads;
  beta = sigmoid(ssm_beta(h)), g = softplus(ssm_alpha(h) + ssm_dt.bias) * ssm_a (g <= 0);
  per value head, the state S (d_k x d_v) decays and takes the delta-rule update
      S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q / sqrt(d_k);
  y = ssm_out(rms_norm(o, ssm_norm) * silu(attn_gate(h))).
The recurrence runs in float32 whatever the compute dtype. `delta_rule` walks the sequence
as ggml's op does (decoding, short prefills); `delta_rule_chunked` computes the same in chunks
of 64 with one triangular solve per chunk (long prefills and training: its backward is far
cheaper). Both take and return the state, so a sequence continues across calls; backward is
autograd's. Both agree with llama.cpp's logits within 1e-4 (docs/exactness.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from retrograd.model.ssm import conv  # ggml's ssm_conv, shared with Mamba-2

CHUNK = 64  # positions per chunk of the chunked form, as llama.cpp's chunked graph


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (llama.cpp's build_gdn_l2_norm)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _heads(q: torch.Tensor, k: torch.Tensor, n_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key heads repeated to the value heads: value head j reads key head j % n_k."""
    r = n_v // q.shape[2]
    return (q, k) if r == 1 else (q.repeat(1, 1, r, 1), k.repeat(1, 1, r, 1))


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, one position at a time. q, k (B, T, H_k, D), v (B, T, H_v, D),
    g, beta (B, T, H_v), state (B, H_v, D_k, D_v) or None (zeros).
    -> (o (B, T, H_v, D_v), the state after the last position), in the inputs' dtype."""
    B, T, H, D = v.shape
    q, k = _heads(q, k, H)
    scale = q.shape[-1] ** -0.5
    if state is None:
        state = v.new_zeros(B, H, k.shape[-1], D)
    decay = g.exp()
    out = []
    for t in range(T):
        kt = k[:, t]  # (B, H, D_k)
        s = state * decay[:, t, :, None, None]
        delta = (v[:, t] - (s * kt[..., None]).sum(-2)) * beta[:, t, :, None]  # (B, H, D_v)
        state = s + kt[..., None] * delta[..., None, :]
        out.append((state * q[:, t, :, :, None]).sum(-2) * scale)
    return torch.stack(out, 1), state


def delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """delta_rule in chunks: within a chunk with cumulative log-decay c_t, the updates d_t
    solve (I + diag(beta) L) d = diag(beta) (v - exp(c) k S0) with L[t, s] = exp(c_t - c_s)
    k_t.k_s (s < t); then o = exp(c) q S0 + M d with M[t, s] = exp(c_t - c_s) q_t.k_s
    (s <= t), and the state exp(c_last) S0 + sum_s exp(c_last - c_s) k_s d_s^T."""
    B, T, H, D = v.shape
    q, k = _heads(q, k, H)
    Dk = k.shape[-1]
    scale = Dk**-0.5
    if state is None:
        state = v.new_zeros(B, H, Dk, D)
    pad = (-T) % chunk
    if pad:  # zero decay and zero beta: padded positions leave the state as it is
        q, k, v, g, beta = (
            F.pad(t, (0,) * (2 * (t.dim() - 2)) + (0, pad)) for t in (q, k, v, g, beta)
        )
    n = (T + pad) // chunk
    # (B, H, n, C, .)
    q, k, v = (t.reshape(B, n, chunk, H, -1).permute(0, 3, 1, 2, 4) for t in (q, k, v))
    g, beta = (t.reshape(B, n, chunk, H).permute(0, 3, 1, 2) for t in (g, beta))
    c = g.cumsum(-1)  # (B, H, n, C)
    diff = c[..., :, None] - c[..., None, :]  # (B, H, n, C, C): c_t - c_s
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    decay = torch.where(lower, diff, torch.full_like(diff, float("-inf"))).exp()
    strict = decay * (~torch.eye(chunk, dtype=torch.bool, device=v.device))
    eye = torch.eye(chunk, dtype=v.dtype, device=v.device)
    a = eye + beta[..., None] * strict * (k @ k.transpose(-1, -2))  # unit lower triangular
    m = decay * (q @ k.transpose(-1, -2))
    enter = c.exp()[..., None]  # (B, H, n, C, 1): the entering state's decay at each position
    last = c[..., -1:]  # (B, H, n, 1)
    k_out = k * (last - c).exp()[..., None]  # k_s exp(c_last - c_s)
    # d = u - w S0: one batched solve for every chunk; the loop only carries the state
    rhs = torch.cat((beta[..., None] * v, beta[..., None] * enter * k), -1)
    u, w = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True).split([D, Dk], -1)
    qe = enter * q
    out = []
    for i in range(n):
        d = u[:, :, i] - w[:, :, i] @ state
        out.append((qe[:, :, i] @ state + m[:, :, i] @ d) * scale)
        state = last[:, :, i, :, None].exp() * state + k_out[:, :, i].transpose(-1, -2) @ d
    o = torch.stack(out, 2).reshape(B, H, n * chunk, D)[:, :, :T]
    return o.transpose(1, 2), state


def mix(block, h: torch.Tensor, ctx) -> torch.Tensor:
    """The delta-net mixer of one layer: h (B, T, n_embd) normed, in the compute dtype -> its
    output before the residual. Its state is (conv inputs (B, d_conv-1, C), S (B, H_v, D, D)),
    both float32. Left padding (ctx.valid False) is skipped: the state passes it unchanged."""
    B, T, _ = h.shape
    norm = block.part("ssm_norm")
    H = block.part("ssm_a").numel()
    D = norm.weight.numel()  # llama.cpp: head_k_dim = head_v_dim = ssm.state_size
    qkv, z, Hk = _qkvz(block, h, H, D)
    beta, alpha = _beta_alpha(block, h, H, Hk)
    beta = torch.sigmoid(beta)  # (B, T, H)
    g = F.softplus(alpha + block.part("ssm_dt.bias")) * block.part("ssm_a")  # log-decay, <= 0
    state = ctx.state(block.il)
    conv_state, s = (None, None) if state is None else state
    n_pad = None
    if ctx.valid is not None:
        n_pad = (~ctx.valid).sum(1)
        keep = ctx.valid.to(g.dtype)[..., None]
        g, beta = g * keep, beta * keep  # no decay, no update: the state passes padding
    x, conv_state = conv(qkv, block.part("ssm_conv1d.weight"), None, conv_state, n_pad)
    x = F.silu(x)
    q, k, v = x.split([Hk * D, Hk * D, H * D], -1)
    eps = block.cfg.rms_eps
    q = l2_norm(q.reshape(B, T, Hk, D), eps)
    k = l2_norm(k.reshape(B, T, Hk, D), eps)
    if block.cfg.arch.delta_net_grouped_heads and Hk != H:  # value head j: key head j // r
        q, k = q.repeat_interleave(H // Hk, 2), k.repeat_interleave(H // Hk, 2)
    # NOTE: the walk's backward is one small graph per position (10-30x slower than the chunks'
    # and a state saved per position): chunks whenever a gradient flows or T is long
    walk = T < CHUNK and not torch.is_grad_enabled()
    rule = delta_rule if walk else delta_rule_chunked
    o, s = rule(q, k, v.reshape(B, T, H, D), g, beta, s)
    ctx.keep(block.il, (conv_state, s))
    o = norm(o) * F.silu(z.float().view(B, T, H, D))
    return block.part("ssm_out")(o.reshape(B, T, H * D).to(ctx.dtype))


def _qkvz(block, h: torch.Tensor, H: int, D: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(the convolution's input q | k | v (B, T, C) float32, the gate z (B, T, H * D), key
    heads) from attn_qkv and attn_gate, or from a legacy fused ssm_in (qwen3next) that holds
    q, k, v and z per key head: (D, D, r D, r D) with r = H / H_k value heads each."""
    B, T, _ = h.shape
    if block.part("attn_qkv") is not None:
        qkv = block.part("attn_qkv")(h).float()
        return qkv, block.part("attn_gate")(h), (qkv.shape[-1] - H * D) // (2 * D)
    qkvz = block.part("ssm_in")(h)
    Hk = (qkvz.shape[-1] - 2 * H * D) // (2 * D)  # the width is H_k (2 D) + 2 H D
    r = H // Hk
    q, k, v, z = qkvz.view(B, T, Hk, -1).split([D, D, r * D, r * D], -1)
    qkv = torch.cat([t.reshape(B, T, -1) for t in (q, k, v)], -1).float()
    return qkv, z.reshape(B, T, H * D), Hk


def _beta_alpha(block, h: torch.Tensor, H: int, Hk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(beta, alpha) logits (B, T, H) float32: ssm_beta and ssm_alpha, or qwen3next's ssm_ba
    holding per key head its r value heads' beta, then their alpha."""
    if block.part("ssm_ba") is None:
        return block.part("ssm_beta")(h).float(), block.part("ssm_alpha")(h).float()
    B, T, _ = h.shape
    b, a = block.part("ssm_ba")(h).float().view(B, T, Hk, -1).chunk(2, -1)
    return b.reshape(B, T, H), a.reshape(B, T, H)
