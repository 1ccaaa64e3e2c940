"""Per-token log-probabilities under the model: the one primitive every loop scores with.

`token_logprobs` gives log p(target | position) for hidden states of given positions, without
materializing (tokens, vocab) logits; `sequence_logprobs` runs the decoder over sequences of
different lengths at once and scores the tokens after each one's prefix; `token_nll_sum` is
SFT's summed negative log-likelihood. The plain path computes the positions' logits at once.
The chunked path walks the positions in chunks of `seq_chunk` and the vocabulary in `tiles`: a
custom autograd function keeps only the hidden states and each position's gradient direction
(a fused linear cross-entropy) and never stores a tile's logits (Gemma's 262k-wide head would
otherwise need 1 MiB of float32 per token, twice). A head with trainable parts (a LoRA on
`output`, a bias) takes a checkpointed chunk path so its parameters still get gradients. Both
equal the plain path (tests/unit/model/test_logprobs.py). Results are float32; `head_dtype`
sets the tiles' product dtype (float32 where a value feeds a ratio: the rollout loops' scores,
whose gradient's product then runs in float32 too, docs/exactness.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from retrograd.compiled import fused
from retrograd.model.decoder import Decoder
from retrograd.model.frozen import FrozenTensor


def token_logprobs(
    decoder: Decoder,
    h: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunked: bool = True,
    tiles: int = 8,
    seq_chunk: int = 512,
    head_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """h (N, n_embd) hidden states of the positions to score, targets (N,) -> (N,) float32
    log-probabilities of the targets, differentiable through h (and a trainable head).

    head_dtype: the dtype of the frozen head's tiles (default: the decoder's compute dtype;
    bench/loss_precision.py measures bf16 tiles against float32 ones, docs/exactness.md)."""
    if h.shape[0] == 0:
        return h.sum(-1) * 0.0
    if not chunked:
        return -F.cross_entropy(decoder.head(h), targets, reduction="none")
    step = seq_chunk if seq_chunk > 0 else h.shape[0]
    frozen = _frozen_head(decoder)
    if frozen is not None and decoder.logit_mul != 1.0:  # granite: (h W^T) / s as (h / s) W^T
        h = h * decoder.logit_mul
    parts = []
    for s in range(0, h.shape[0], step):
        hc, tc = h[s : s + step], targets[s : s + step]
        if frozen is not None:
            dtype = head_dtype or decoder.compute_dtype
            cap = decoder.cfg.final_softcap
            parts.append(-_TiledHeadCE.apply(hc, tc, frozen, dtype, tiles, cap))
        else:
            parts.append(-checkpoint(_plain_nll, decoder, hc, tc, use_reentrant=False))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def token_nll_sum(decoder: Decoder, h: torch.Tensor, targets: torch.Tensor, **options):
    """The summed negative log-likelihood of the targets: a scalar float32 (SFT's loss)."""
    return -token_logprobs(decoder, h, targets, **options).sum()


def sequence_logprobs(
    decoder: Decoder,
    rows: list[tuple[list[int], int]],
    *,
    chunked: bool = True,
    tiles: int = 8,
    seq_chunk: int = 512,
    head_dtype: torch.dtype | None = torch.float32,
) -> list[torch.Tensor]:
    """rows: (ids, first) pairs -> per row, the log-probabilities (len(ids) - first,) float32
    of ids[first:] each given the ids before it, in one forward over the rows.

    Rows of different lengths are right-padded: attention is causal, so no real position sees
    a padding one and nothing is masked; padded positions are not scored. Differentiable when
    grad is enabled. `first` >= 1 (the first id has no prediction)."""
    opts = {"chunked": chunked, "tiles": tiles, "seq_chunk": seq_chunk, "head_dtype": head_dtype}
    return _per_answer(decoder, *_row_states(decoder, rows), **opts)


def _per_answer(decoder, h, targets, sizes, **opts) -> list[torch.Tensor]:
    """The scored states' log-probabilities, split per answer."""
    return list(token_logprobs(decoder, h, targets, **opts).split(sizes))


def sequence_hidden(decoder: Decoder, rows: list[tuple[list[int], int]]) -> list[torch.Tensor]:
    """Per row (len(ids) - first, n_embd), the final hidden states that predict ids[first:]:
    what sequence_logprobs scores, without the head (PPO's value-head features)."""
    h, _, sizes = _row_states(decoder, rows)
    return list(h.split(sizes))


def _row_states(decoder: Decoder, rows: list[tuple[list[int], int]]):
    """One forward over the right-padded rows -> the scored positions' final hidden states
    (N, n_embd), their targets (N,) and each row's count."""
    dev = decoder.device
    width = max(len(ids) for ids, _ in rows)
    batch = torch.zeros(len(rows), width, dtype=torch.long, device=dev)
    for i, (ids, first) in enumerate(rows):
        assert 1 <= first <= len(ids), (first, len(ids))
        batch[i, : len(ids)] = torch.tensor(ids, device=dev)
    h = decoder(batch)  # (B, width, n_embd)
    row_idx = torch.cat(
        [
            torch.full((len(ids) - first,), i, dtype=torch.long)
            for i, (ids, first) in enumerate(rows)
        ]
    ).to(dev)
    pos = torch.cat([torch.arange(first - 1, len(ids) - 1) for ids, first in rows]).to(dev)
    sizes = [len(ids) - first for ids, first in rows]
    return h[row_idx, pos], batch[row_idx, pos + 1], sizes


def _plain_nll(decoder: Decoder, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(decoder.head(h), targets, reduction="none")


def _frozen_head(decoder: Decoder) -> FrozenTensor | None:
    """The head's weight when nothing in the head trains, else None."""
    out = decoder.output
    if out is None:
        return decoder.token_embd
    if out.lora is None and out.bias is None and out.weight is None:
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
    """-log softmax(h_i W^T)[t_i] per row i, over vocabulary tiles, for a frozen W.

    When h needs a gradient, forward also accumulates it: with an online softmax (running
    max m, running sum s), acc = sum_tiles exp(z - m) @ W is rescaled whenever m grows, and
    d(nll_i)/dh_i = acc_i / s_i - W[t_i] at the end. Each tile's logits are computed once (a fused
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
        return (lse - target_logit)[:n_real]

    @staticmethod
    def backward(ctx, grad_out):
        (grad_h,) = ctx.saved_tensors
        return grad_h * grad_out[:, None], None, None, None, None, None


class _SharedPrefix:
    """A cache of one prompt's keys and values that keeps their graph: the prompt's pass
    (start 0) stores them; its answers' pass attends to them, expanded to every answer (a
    view, no copy), so one backward reaches the prompt's positions through every answer."""

    def __init__(self):
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.states: dict[int, tuple[torch.Tensor, ...]] = {}  # recurrent layers, with graph
        self.length = 0

    def read_state(self, layer: int, start: int, batch: int) -> tuple[torch.Tensor, ...]:
        return tuple(t.expand(batch, *t.shape[1:]) for t in self.states[layer])

    def write_state(self, layer: int, start: int, end: int, state) -> None:
        if start == 0:
            self.states[layer] = state

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int):
        if start == 0:
            self.k[layer], self.v[layer] = k, v
            return k, v
        n = k.shape[0]
        pk = self.k[layer].expand(n, -1, -1, -1).to(k.dtype)
        pv = self.v[layer].expand(n, -1, -1, -1).to(v.dtype)
        return torch.cat((pk, k), 2), torch.cat((pv, v), 2)


def shared_prefix_logprobs(
    decoder: Decoder,
    prompt: list[int],
    answers: list[list[int]],
    *,
    chunked: bool = True,
    tiles: int = 8,
    seq_chunk: int = 512,
    head_dtype: torch.dtype | None = torch.float32,
) -> list[torch.Tensor]:
    """sequence_logprobs of rows prompt + answer, with the prompt run once (formats.md §8.2,
    shared_prefix_fanout): a pass over the prompt, then one over the answers (right-padded)
    attending to its keys and values. The same values and gradients as the rows, up to the
    order of float sums (tests/unit/model/test_logprobs.py)."""
    opts = {"chunked": chunked, "tiles": tiles, "seq_chunk": seq_chunk, "head_dtype": head_dtype}
    return _per_answer(decoder, *_shared_states(decoder, prompt, answers), **opts)


def shared_prefix_hidden(
    decoder: Decoder, prompt: list[int], answers: list[list[int]]
) -> list[torch.Tensor]:
    """The final hidden states shared_prefix_logprobs scores, without the head."""
    hs, _, sizes = _shared_states(decoder, prompt, answers)
    return list(hs.split(sizes))


def _shared_states(decoder: Decoder, prompt: list[int], answers: list[list[int]]):
    """The prompt once, then the answers on its cache -> the states that predict each answer
    token (N, n_embd), those tokens (N,) and each answer's count."""
    dev = decoder.device
    cache = _SharedPrefix()
    hp = decoder(torch.tensor([prompt], device=dev), cache=cache)[0]  # (P, n_embd)
    width = max(len(a) for a in answers)
    batch = torch.zeros(len(answers), width, dtype=torch.long, device=dev)
    for i, a in enumerate(answers):
        assert a, "an empty answer has nothing to score"
        batch[i, : len(a)] = torch.tensor(a, device=dev)
    h = decoder(batch, start=len(prompt), cache=cache)  # (G, width, n_embd)
    # answer i's token j is predicted by the prompt's last position (j = 0) or by h[i, j - 1]
    hs = torch.cat([torch.cat((hp[-1:], h[i, : len(a) - 1])) for i, a in enumerate(answers)])
    targets = torch.tensor([t for a in answers for t in a], dtype=torch.long, device=dev)
    return hs, targets, [len(a) for a in answers]


def ids_logprobs(
    decoder: Decoder, h: torch.Tensor, ids: torch.Tensor, *, seq_chunk: int = 64
) -> torch.Tensor:
    """h (N, n_embd) hidden states, ids (N, k) token ids -> (N, k) float32 log-probabilities
    of those ids at each position, normalised over the whole vocabulary; differentiable
    through h (and a trainable head). At most `seq_chunk` positions' logits live at once: under
    grad each chunk is recomputed in backward instead of stored (offline top-k distillation)."""
    step = seq_chunk if seq_chunk > 0 else max(h.shape[0], 1)
    grad = torch.is_grad_enabled() and (h.requires_grad or _frozen_head(decoder) is None)
    parts = []
    for s in range(0, h.shape[0], step):
        hc, ic = h[s : s + step], ids[s : s + step]
        if grad:
            parts.append(checkpoint(_ids_logprobs, decoder, hc, ic, use_reentrant=False))
        else:
            parts.append(_ids_logprobs(decoder, hc, ic))
    if not parts:
        return h.new_zeros((0, ids.shape[1]), dtype=torch.float32)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _ids_logprobs(decoder: Decoder, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    logits = decoder.head(h)  # (n, V) float32
    return logits.gather(1, ids) - torch.logsumexp(logits, -1, keepdim=True)


@torch.no_grad()
def topk_logprobs(
    decoder: Decoder, h: torch.Tensor, k: int, *, seq_chunk: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """h (N, n_embd) -> the k most likely next tokens at each position: ids (N, k) int64 and
    their log-probabilities (N, k) float32, most likely first."""
    ids, lps = [], []
    step = seq_chunk if seq_chunk > 0 else max(h.shape[0], 1)
    for s in range(0, h.shape[0], step):
        logp = torch.log_softmax(decoder.head(h[s : s + step]), -1)
        v, i = torch.topk(logp, k, dim=-1, sorted=True)
        ids.append(i)
        lps.append(v)
    if not ids:
        return (
            torch.zeros(0, k, dtype=torch.long, device=h.device),
            torch.zeros(0, k, device=h.device),
        )
    return torch.cat(ids), torch.cat(lps)
