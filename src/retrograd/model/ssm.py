"""Mamba-2 state-space mixing (mamba2, falcon-h1): the causal conv, the selective scan, the mixer.

The math is ggml's `ssm_conv` and `ssm_scan` ops as llama.cpp's build_mamba2_layer chains them:
in-projection to (z, xBC, dt); a causal depthwise conv over xBC whose state is the last
d_conv - 1 inputs; silu; the scan, per head h with scalar decay exp(dt_h * A_h) and B/C shared by
the heads of a group; y + x * D; y * silu(z); a grouped RMSNorm (when the file has ssm_norm);
the out-projection. The layer's recurrent state is (conv state (B, d_conv - 1, conv_dim),
ssm state (B, n_head, head_dim, d_state)), batch first, float32 whatever the compute dtype.

`scan_steps` walks the sequence as ggml does (the reference, and single-token decode);
`scan_chunked` is the same recurrence in chunks (the state-space dual form): the state is
materialized only at chunk ends, so prefill and training keep O(T / chunk) states in memory,
and it matches llama.cpp as closely. Backward is autograd through either. Knows nothing of
the decoder beyond `block.part`, `block.attention` and the context's state and padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from retrograd.errors import GGUFError

CHUNK = 64  # tokens per chunk of the chunked scan


def conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: torch.Tensor | None = None,
    pad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv (ggml_ssm_conv, plus the bias) -> (y (B, T, C), new state).

    x (B, T, C); weight (C, K) as stored; state (B, K - 1, C): the K - 1 inputs before x[:, 0]
    (None: zeros). y[t] = bias + sum_k weight[:, k] * xx[t + k] with xx = state ++ x.
    pad (B,): left-padding positions per row, whose inputs must be zero: each row then sees
    state ++ x[pad:], as if the padding were not there, and its new state ignores the padding.
    """
    B, T, Cn = x.shape
    K = weight.shape[1]
    if state is None:
        state = x.new_zeros(B, K - 1, Cn)
    xx = torch.cat((state.to(x.dtype), x), 1)  # (B, K - 1 + T, C)
    if pad is not None and bool((pad > 0).any()):
        xx = xx.gather(1, _unpad_index(pad, K, T)[:, :, None].expand(-1, -1, Cn))
    w = weight.to(x.dtype)
    # NOTE: taps summed in order k = 0, 1, ... from zero, as ggml's ssm_conv: float32 digit
    # for digit
    y = xx[:, 0:T] * w[:, 0]
    for k in range(1, K):
        y = y + xx[:, k : k + T] * w[:, k]
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y, xx[:, T:]  # the last K - 1 inputs


def _unpad_index(pad: torch.Tensor, K: int, T: int) -> torch.Tensor:
    """(B, K - 1 + T) gather index that moves each row's p padding inputs (zeros) in front of
    its state: j < p -> a padding input; p <= j < p + K - 1 -> state[j - p]; else x[j - K + 1]."""
    j = torch.arange(K - 1 + T, device=pad.device)[None, :]  # (1, S)
    p = pad[:, None]  # (B, 1)
    return torch.where(j < p, K - 1 + j, torch.where(j < p + K - 1, j - p, j))


def softplus(dt: torch.Tensor) -> torch.Tensor:
    """ggml's softplus: x above 20, else log(1 + e^x)."""
    return F.softplus(dt, beta=1.0, threshold=20.0)


def scan_steps(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selective scan one position at a time (ggml_ssm_scan) -> (y, final state).

    x (Bt, T, H, P); dt (Bt, T, H) the step after softplus (0 leaves the state unchanged);
    A (H,) negative decay rates; B, C (Bt, T, G, N), head h reading group h // (H / G);
    state (Bt, H, P, N) or None (zeros). Per step: s = s * exp(dt A) + (x dt) outer B;
    y = s . C. y (Bt, T, H, P).
    """
    Bt, T, H, P = x.shape
    Bh, Ch = _heads(B, H), _heads(C, H)  # (Bt, T, H, N)
    s = x.new_zeros(Bt, H, P, B.shape[-1]) if state is None else state
    dA = torch.exp(dt * A)  # (Bt, T, H)
    xdt = x * dt[..., None]  # (Bt, T, H, P)
    ys = []
    for t in range(T):
        s = s * dA[:, t, :, None, None] + xdt[:, t, :, :, None] * Bh[:, t, :, None, :]
        ys.append((s * Ch[:, t, :, None, :]).sum(-1))  # (Bt, H, P)
    return torch.stack(ys, 1), s


def scan_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`scan_steps` in chunks of `chunk` positions: within a chunk, y is a masked (decayed)
    attention of C over B plus the decayed entry state read by C; the state passes from chunk
    to chunk. Same arguments and results, equal up to float rounding."""
    Bt, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    L = min(chunk, T)
    n = -(-T // L)
    if n * L != T:  # pad with dt = 0, x = 0: steps that leave the state as it is
        extra = n * L - T
        x, dt, B, C = (F.pad(t, (0,) * (2 * t.dim() - 4) + (0, extra)) for t in (x, dt, B, C))
    R = H // G
    x = x.view(Bt, n, L, G, R, P)
    a = (dt * A).view(Bt, n, L, G, R)  # log decay per step
    xdt = x * dt.view(Bt, n, L, G, R, 1)
    B, C = B.view(Bt, n, L, G, N), C.view(Bt, n, L, G, N)
    acum = a.cumsum(2)  # (Bt, n, L, G, R)
    # within a chunk: y[t] += sum_{s <= t} exp(a[s+1] + ... + a[t]) (C[t] . B[s]) xdt[s]
    decay = torch.exp(_segsum(a.permute(0, 1, 3, 4, 2)))  # (Bt, n, G, R, L, L)
    cb = torch.einsum("bctgn,bcsgn->bcgts", C, B)  # (Bt, n, G, L, L)
    y = torch.einsum("bcgrts,bcsgrp->bctgrp", decay * cb[:, :, :, None], xdt)
    # the chunk's own contribution to the state at its end
    to_end = decay[..., -1, :]  # (Bt, n, G, R, L): exp(a[s+1] + ... + a[L-1])
    s_chunk = torch.einsum("bcgrl,bclgrp,bclgn->bcgrpn", to_end, xdt, B)
    s = x.new_zeros(Bt, G, R, P, N) if state is None else state.view(Bt, G, R, P, N)
    entry = []
    for c in range(n):  # the state entering each chunk
        entry.append(s)
        s = s * torch.exp(acum[:, c, -1])[..., None, None] + s_chunk[:, c]
    entry = torch.stack(entry, 1)  # (Bt, n, G, R, P, N)
    y = y + torch.einsum("bctgn,bcgrpn->bctgrp", C, entry) * torch.exp(acum)[..., None]
    return y.reshape(Bt, n * L, H, P)[:, :T], s.view(Bt, H, P, N)


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """(..., L) -> (..., L, L): [t, s] = a[s+1] + ... + a[t] for s <= t, -inf above. Summed
    from s, not as a difference of cumulative sums, so that long chunks lose no precision."""
    L = a.shape[-1]
    rows = a[..., :, None].expand(*a.shape, L)  # [r, s] = a[r]
    below = torch.ones(L, L, dtype=torch.bool, device=a.device).tril(-1)  # r > s
    seg = rows.masked_fill(~below, 0.0).cumsum(-2)  # [t, s] = sum_{s < r <= t} a[r]
    keep = torch.ones(L, L, dtype=torch.bool, device=a.device).tril()
    return seg.masked_fill(~keep, float("-inf"))


def _heads(bc: torch.Tensor, H: int) -> torch.Tensor:
    """B or C (Bt, T, G, N) -> per head (Bt, T, H, N): head h reads group h // (H / G)."""
    return bc.repeat_interleave(H // bc.shape[2], dim=2)


def scan(x, dt, A, B, C, state=None):
    """The scan by the path that fits: a single step (decoding) walked, longer runs chunked.
    NOTE: both agree with llama.cpp's walked float32 scan to the same few 1e-5 on logits
    (docs/exactness.md); only memory and speed differ."""
    if x.shape[1] == 1:
        return scan_steps(x, dt, A, B, C, state)
    return scan_chunked(x, dt, A, B, C, state)


def mix(block, h: torch.Tensor, ctx) -> torch.Tensor:
    """The Mamba-2 mixer (mamba2's layers): h (B, T, n_embd) normed input -> (B, T, n_embd)."""
    cfg, il = block.cfg, block.il
    d_inner, n_group, d_state = cfg.ssm_d_inner, cfg.ssm_n_group, cfg.ssm_d_state
    H = cfg.ssm_dt_rank  # heads
    Bt, T, _ = h.shape
    zxbcdt = _need(block, "ssm_in")(h).float()  # (B, T, 2 d_inner + 2 G N + H)
    z, xbc, dt = zxbcdt.split([d_inner, d_inner + 2 * n_group * d_state, H], -1)
    state = ctx.state(il)
    conv_state, ssm_state = (None, None) if state is None else state
    pad = None
    if ctx.valid is not None:  # left padding: no input, and no step of the scan
        # NOTE: valid is False on a prefix of each row (left padding), so its count places it
        xbc = xbc * ctx.valid[..., None]
        pad = (~ctx.valid).sum(1)
    xbc, conv_state = conv(
        xbc, _need(block, "ssm_conv1d.weight"), block.part("ssm_conv1d.bias"), conv_state, pad
    )
    xbc = F.silu(xbc)
    x, b, c = xbc.split([d_inner, n_group * d_state, n_group * d_state], -1)
    x = x.view(Bt, T, H, d_inner // H)  # (B, T, H, P)
    b, c = b.view(Bt, T, n_group, d_state), c.view(Bt, T, n_group, d_state)
    dt = softplus(dt + _need(block, "ssm_dt.bias"))  # (B, T, H)
    if ctx.valid is not None:
        dt = dt * ctx.valid[..., None]
    A = _need(block, "ssm_a").reshape(H)
    y, ssm_state = scan(x, dt, A, b, c, ssm_state)
    ctx.keep(il, (conv_state, ssm_state))
    y = y + x * _need(block, "ssm_d").reshape(H, 1)
    y = y.reshape(Bt, T, d_inner) * F.silu(z)  # ggml swiglu_split(z, y)
    norm = block.part("ssm_norm")
    if norm is not None:  # grouped RMSNorm: weight (G, d_inner / G)
        y = norm(y.view(Bt, T, n_group, d_inner // n_group)).reshape(Bt, T, d_inner)
    return _need(block, "ssm_out")(y.to(ctx.dtype))


def _need(block, name: str):
    """A part every Mamba-2 layer has; a file without it fails here, naming the tensor."""
    part = block.part(name)
    if part is None:
        suffix = ".weight" if name in ("ssm_in", "ssm_out") else ""
        raise GGUFError(f"{block.cfg.name} model is missing tensor blk.{block.il}.{name}{suffix}")
    return part


def mix_parallel(block, h: torch.Tensor, ctx) -> torch.Tensor:
    """Falcon-H1's layer: attention and the Mamba-2 mixer read the same normed input, and their
    outputs add (its multipliers are folded into the weights by the converter)."""
    return block.attention(h, ctx, h) + mix(block, h, ctx)
