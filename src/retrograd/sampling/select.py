"""Choosing the next token from logits: greedy, temperature, top-p, and its log-probability.

One rule on both sides, so that host and device sampling draw from the same distribution:
each sequence brings one uniform number u per step (from its own generator, see `engine.py`);
the token is the inverse CDF at u of the tempered distribution, truncated to its nucleus when
top_p < 1. The CDF runs over the vocabulary in id order when top_p = 1 (no sort needed) and
over the probabilities sorted high to low (stable: equal values keep id order) otherwise. The
rule depends only on the row's own logits, settings and u, never on its batch.

The device path keeps the (B, V) logits where they are and returns B token ids; the host path
copies them and computes in float64 (the oracle). A nucleus row is found without sorting its
vocabulary wherever the choice is certain to be the full sort's, in two tries: (1) the
NUCLEUS_CANDIDATES most likely tokens of every row (`torch.topk`, then put in the full sort's
order: high to low, equal values by id), deciding a row when its nucleus ends before the last
candidate and the chosen token is more likely than the last one (a token tied with that one
may sit outside the candidates); (2) for each row left, every token at or above a power of two
(a histogram of float32 exponents picks the highest one whose tokens hold top_p; no tie
crosses that line), sorted, deciding when the nucleus ends before the last of them. Rows left
after both sort their whole vocabulary. All read the same probabilities, and a prefix's
running sums are the sorted row's first ones, so the token is the full sort's for the same
u, bit for bit (the CPU's cumulative sum is one sequential pass, whatever the row's length;
not yet checked on a GPU, where it rests on the scan's prefixes not depending on the row's
length either). `fast_top_p = False` sorts every nucleus row. Nothing here knows about models
or text.
"""

from __future__ import annotations

import numpy as np
import torch

from retrograd.compiled import fused

NUCLEUS_CANDIDATES = 256  # tokens searched first for a nucleus
EXPONENTS = 128  # float32 exponents of probabilities in [0, 1]


def select_device(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    u: torch.Tensor,
    fast_top_p: bool = True,
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
    full = _rows(~greedy & (top_p >= 1))  # inverse CDF in id order
    if full is not None:
        probs = torch.softmax(logits[full] / temperature[full, None], -1)  # (b, V)
        cdf = probs.cumsum(-1)
        x = (u[full].to(cdf.dtype) * cdf[:, -1])[:, None]
        out[full] = torch.searchsorted(cdf, x, right=True)[:, 0].clamp_max(cdf.shape[1] - 1)
    nucleus = _rows(~greedy & (top_p < 1))
    if nucleus is not None:
        rows = logits[nucleus] / temperature[nucleus, None]
        out[nucleus] = _nucleus(rows, top_p[nucleus], u[nucleus], fast_top_p)
    return out


def _rows(mask: torch.Tensor) -> torch.Tensor | slice | None:
    """An index of the rows in `mask`: None when there are none, a slice (a view, no copy of
    the (B, V) logits) when it is every row."""
    if not bool(mask.any()):
        return None
    return slice(None) if bool(mask.all()) else mask


def _nucleus(scaled: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor, fast: bool):
    """Inverse CDF over the sorted nucleus; scaled (b, V) -> ids (b,)."""
    probs = torch.softmax(scaled, -1)  # (b, V)
    if fast and probs.shape[1] > NUCLEUS_CANDIDATES:
        out, sure = nucleus_from_candidates(probs, top_p, u, NUCLEUS_CANDIDATES)
        for r in (~sure).nonzero()[:, 0].tolist():  # a wider nucleus, or a tie at the 256th
            token = nucleus_above(probs[r], top_p[r], u[r])
            if token is not None:
                out[r], sure[r] = token, True
    else:
        out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
        sure = torch.zeros_like(out, dtype=torch.bool)
    rest = _rows(~sure)
    if rest is not None:
        vals, idx = probs[rest].sort(dim=-1, descending=True, stable=True)  # (b', V)
        k, _ = _position(vals, top_p[rest], u[rest])
        out[rest] = idx.gather(-1, k[:, None])[:, 0]
    return out


def nucleus_from_candidates(
    probs: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor, k: int = NUCLEUS_CANDIDATES
) -> tuple[torch.Tensor, torch.Tensor]:
    """probs (b, V) -> (ids (b,), sure (b,) bool): the full sort's token wherever `sure`, from
    the k most likely tokens alone."""
    vals, idx = probs.topk(k, -1)  # (b, k), high to low; equal values in no promised order
    idx, by_id = idx.sort(-1)  # NOTE: topk's order of equal values is not the stable sort's
    vals, order = vals.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    idx = idx.gather(-1, order)  # the stable full sort's order among the candidates
    pos, n_keep = _position(vals, top_p, u)
    # the nucleus ends before the last candidate (keep is a prefix: the full sort keeps no
    # more), and no token outside the candidates ties with the chosen one
    sure = (n_keep < k) & (vals.gather(-1, pos[:, None])[:, 0] > vals[:, -1])
    return idx.gather(-1, pos[:, None])[:, 0], sure


def nucleus_above(probs: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> int | None:
    """One row's probabilities (V,) -> the full sort's token, from the tokens at or above a
    power of two (every token of those float32 exponents: no tie crosses the line), the
    highest power whose tokens hold top_p by a histogram of exponents; None where the row
    must be sorted (the nucleus reaches the last of those tokens)."""
    exponent = probs.view(torch.int32) >> 23  # (V,) p >= 2**(exponent - 127) for p > 0
    mass = torch.bincount(exponent, weights=probs, minlength=EXPONENTS)  # (128,)
    above = mass.flip(0).cumsum(0).flip(0)  # the mass of every exponent from e up
    # NOTE: the histogram only picks the line; the check below makes the choice exact. The
    # margin: one token of the lowest exponent (p < 2**(e - 126)) and float32 rounding.
    margin = torch.exp2(torch.arange(EXPONENTS, device=probs.device) - 126.0) + 1e-4
    enough = (above >= top_p + margin).nonzero()[:, 0]
    if len(enough) == 0 or int(enough[-1]) == 0:  # exponent 0 holds zeros and denormals
        return None
    idx = (exponent >= enough[-1]).nonzero()[:, 0]  # (n,) ids in increasing order
    vals, order = probs[idx].sort(descending=True, stable=True)  # the sorted row's first n
    pos, n_keep = _position(vals[None], top_p[None], u[None])
    return int(idx[order[pos[0]]]) if int(n_keep[0]) < len(idx) else None


def _position(vals: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor):
    """vals (b, K) probabilities sorted high to low -> (the chosen position (b,), the nucleus
    size (b,)). The nucleus keeps the smallest prefix whose mass reaches top_p (the crossing
    token included). NOTE: position i reads vals[:i + 1] only (cumsum's prefixes), which makes
    a prefix of the sorted row choose what the whole row does."""
    cdf = vals.cumsum(-1)  # (b, K)
    keep = (cdf - vals) < top_p[:, None]  # mass before the token is still short of top_p
    n_keep = keep.sum(-1).clamp_min(1)  # (b,)
    mass = cdf.gather(-1, (n_keep - 1)[:, None])  # (b, 1)
    x = u.to(cdf.dtype)[:, None] * mass
    pos = torch.searchsorted(cdf, x, right=True).clamp_max(n_keep[:, None] - 1)  # (b, 1)
    return pos[:, 0], n_keep


def select_host(
    logits: torch.Tensor, temperature, top_p, u, fast_top_p: bool = True
) -> torch.Tensor:
    """The same rule in float64 on the host (RETRO_DEVICE_SAMPLING=0); returns ids on the host.
    fast_top_p is accepted for `select_device`'s signature: the oracle always sorts."""
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
