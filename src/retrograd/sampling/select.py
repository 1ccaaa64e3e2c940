"""Choosing the next token from logits: greedy, temperature, top-p, and its log-probability.

One rule on both sides, so that host and device sampling draw from the same distribution:
each sequence brings one uniform number u per step (from its own generator, see `engine.py`);
the token is the inverse CDF at u of the tempered distribution, truncated to its nucleus when
top_p < 1. The CDF runs over the vocabulary in id order when top_p = 1 (no sort needed) and
over the probabilities sorted high to low (stable: equal values keep id order) otherwise. The
rule depends only on the row's own logits, settings and u, never on its batch.

The device path keeps the (B, V) logits where they are and returns B token ids; the host path
copies them and computes in float64 (the oracle). `fast_top_p` finds the nucleus among the top
256 candidates when they hold enough mass, falling back to the full sort when they do not;
equal probabilities may then be ordered differently. Nothing here knows about models or text.
"""

from __future__ import annotations

import numpy as np
import torch

from retrograd.compiled import fused

FAST_TOP_K = 256  # candidates tried first by fast top-p


def select_device(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    u: torch.Tensor,
    fast_top_p: bool = False,
) -> torch.Tensor:
    """logits (B, V) float32 (or bf16/f16: the same values widened), temperature/top_p/u (B,)
    -> token ids (B,) long, on logits' device.

    temperature 0 is greedy (argmax; u is ignored).
    """
    B = logits.shape[0]
    greedy = temperature <= 0
    if bool(greedy.all()):
        return _argmax(logits)
    out = torch.empty(B, dtype=torch.long, device=logits.device)
    if greedy.any():
        out[greedy] = _argmax(logits[greedy])
    logits = logits.float()
    full = ~greedy & (top_p >= 1)  # inverse CDF in id order
    if full.any():
        probs = torch.softmax(logits[full] / temperature[full, None], -1)  # (b, V)
        cdf = probs.cumsum(-1)
        x = (u[full].to(cdf.dtype) * cdf[:, -1])[:, None]
        out[full] = torch.searchsorted(cdf, x, right=True)[:, 0].clamp_max(cdf.shape[1] - 1)
    nucleus = ~greedy & (top_p < 1)
    if nucleus.any():
        rows = logits[nucleus] / temperature[nucleus, None]
        out[nucleus] = _nucleus(rows, top_p[nucleus], u[nucleus], fast_top_p)
    return out


def _nucleus(scaled: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor, fast: bool):
    """Inverse CDF over the sorted nucleus; scaled (b, V) -> ids (b,)."""
    probs = torch.softmax(scaled, -1)  # (b, V)
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    todo = torch.ones(probs.shape[0], dtype=torch.bool, device=probs.device)
    if fast and probs.shape[1] > FAST_TOP_K:
        vals, idx = probs.topk(FAST_TOP_K, -1)  # (b, K), sorted high to low
        enough = vals.sum(-1) >= top_p
        if enough.any():
            out[enough] = _pick(vals[enough], idx[enough], top_p[enough], u[enough])
            todo = ~enough
    if todo.any():
        vals, idx = probs[todo].sort(dim=-1, descending=True, stable=True)  # (b, V)
        out[todo] = _pick(vals, idx, top_p[todo], u[todo])
    return out


def _pick(vals, idx, top_p, u) -> torch.Tensor:
    """vals (b, K) sorted probabilities with their ids idx; the nucleus keeps the smallest prefix
    whose mass reaches top_p (the crossing token included)."""
    cdf = vals.cumsum(-1)  # (b, K)
    keep = (cdf - vals) < top_p[:, None]  # mass before the token is still short of top_p
    n_keep = keep.sum(-1).clamp_min(1)  # (b,)
    mass = cdf.gather(-1, (n_keep - 1)[:, None])  # (b, 1)
    x = u.to(cdf.dtype)[:, None] * mass
    k = torch.searchsorted(cdf, x, right=True).clamp_max(n_keep[:, None] - 1)  # (b, 1)
    return idx.gather(-1, k)[:, 0]


def select_host(
    logits: torch.Tensor, temperature, top_p, u, fast_top_p: bool = False
) -> torch.Tensor:
    """The same rule in float64 on the host (RETRO_DEVICE_SAMPLING=0); returns ids on the host."""
    z = logits.detach().double().cpu().numpy()  # (B, V)
    temps, tops, us = (np.asarray(_host(t), dtype=np.float64) for t in (temperature, top_p, u))
    out = np.empty(z.shape[0], dtype=np.int64)
    for b in range(z.shape[0]):
        if temps[b] <= 0:
            out[b] = int(np.argmax(z[b]))
            continue
        s = z[b] / temps[b]
        p = np.exp(s - s.max())
        p /= p.sum()
        order = np.arange(p.size) if tops[b] >= 1 else np.argsort(-p, kind="stable")
        vals = p[order]
        cdf = np.cumsum(vals)
        n_keep = p.size if tops[b] >= 1 else max(1, int(np.sum((cdf - vals) < tops[b])))
        k = int(np.searchsorted(cdf[:n_keep], us[b] * cdf[n_keep - 1], side="right"))
        out[b] = order[min(k, n_keep - 1)]
    return torch.from_numpy(out)


def _host(t):
    return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else t


def token_logprobs_device(
    logits: torch.Tensor, temperature: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """log p(token) under softmax(logits / T), T = 1 for greedy rows; (B,) float32."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    picked = logits.gather(-1, tokens[:, None])[:, 0].float() / t
    return picked - _tempered_logsumexp(logits, t)


@fused(dynamic={0: (0,)})
def greedy_device(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy rows (B, V) -> (token ids (B,) long, their log-probabilities (B,) float32): what
    `select_device` and `token_logprobs_device` give at temperature 0, in one fused kernel
    that reads the logits twice (max and argmax, then the sum) instead of four times."""
    z = logits.float()
    top = z.amax(-1, keepdim=True)
    return z.argmax(-1), -torch.log(torch.exp(z - top).sum(-1))


@fused(dynamic={0: (0,)})
def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest logit. NOTE: fused because PyTorch's own argmax
    over 16-bit rows is not vectorized on the CPU (3.5 ms for 8 rows of 262k, 0.3 ms here)."""
    return logits.float().argmax(-1)


@fused(dynamic={0: (0,), 1: (0,)})
def _tempered_logsumexp(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """logsumexp(logits / t) per row, fused: one read of the (B, V) logits per pass instead of
    a scaled copy and four passes (5 ms a step for 8 rows of a 262k vocabulary)."""
    return torch.logsumexp(logits.float() / t[:, None], -1)


def token_logprobs_host(logits: torch.Tensor, temperature, tokens) -> torch.Tensor:
    """The float64 host oracle of `token_logprobs_device` (RETRO_DEVICE_LOGPROBS=0)."""
    z = logits.detach().double().cpu()  # (B, V)
    t = torch.as_tensor(_host(temperature), dtype=torch.float64)
    t = torch.where(t > 0, t, torch.ones_like(t))
    scaled = z / t[:, None]
    tok = torch.as_tensor(_host(tokens), dtype=torch.long)
    return (scaled.gather(-1, tok[:, None])[:, 0] - torch.logsumexp(scaled, -1)).float()
