"""Preference pairs scored by the policy: the passes over whole pairs, their summed
log-probabilities, a loss's statistics per pair, the reference scores and their file.

A pass holds whole pairs within micro_batch tokens, at least one pair (which may exceed it): a
pair whose prompt and both answers fit is scored after one pass over its prompt (shared); the
rest go as two rows each, several pairs' rows in one pass where they fit. Under torchrun each
rank runs its share of the passes; under fsdp2 every rank runs every pass (the gathers are
collectives). Knows the decoder, the pairs and a loss function; not the loop, its schedule or
its checkpoints (algorithms/preference.py).
"""

from __future__ import annotations

import contextlib
import struct
from dataclasses import dataclass

import numpy as np
import torch

from retrograd import distributed
from retrograd.algorithms import context
from retrograd.data.pairs import TokenPair
from retrograd.errors import CheckpointError
from retrograd.losses.preference import PreferenceLossOut
from retrograd.model.logprobs import sequence_logprobs, shared_prefix_logprobs
from retrograd.observe import names

REFERENCE = "preference-reference.bin"  # artifact: reference scores (formats.md §5.1)
FIRST = "preference-first.bin"  # artifact: each pair's first scores (logps_drop_warn)
MAGICS = {REFERENCE: b"RGPREFRF", FIRST: b"RGPREFFS"}


@dataclass
class Scores:
    """Summed log-probabilities of each pair's written tokens, float32 (N,) each."""

    chosen: np.ndarray
    rejected: np.ndarray

    @classmethod
    def unset(cls, n: int) -> Scores:
        return cls(np.full(n, np.nan, np.float32), np.full(n, np.nan, np.float32))


@dataclass(frozen=True)
class Piece:
    """Pairs scored in one forward: one pair after a pass over its prompt (shared), or rows
    prompt + answer, two a pair."""

    pairs: tuple[int, ...]
    shared: bool


def shared_tokens(p: TokenPair) -> int:
    """Tokens of a pair's shared-prompt passes: the prompt, then both answers padded."""
    return len(p.prompt) + 2 * max(len(p.chosen), len(p.rejected))


def pieces_of(pairs: list[TokenPair], members: list[int], budget: int, fanout) -> list[Piece]:
    """The passes over `members`: whole pairs within `budget` tokens, one pair at least."""
    out, rows, width = [], [], 0
    for i in members:
        p = pairs[i]
        if fanout not in ("auto", "off") or (fanout == "auto" and shared_tokens(p) <= budget):
            out.append(Piece((i,), True))
            continue
        w = len(p.prompt) + max(len(p.chosen), len(p.rejected))
        if rows and max(width, w) * 2 * (len(rows) + 1) > budget:
            out.append(Piece(tuple(rows), False))
            rows, width = [], 0
        rows.append(i)
        width = max(width, w)
    return out + ([Piece(tuple(rows), False)] if rows else [])


def score(decoder, pairs: list[TokenPair], piece: Piece, training) -> tuple[torch.Tensor, ...]:
    """(chosen, rejected) (P,) float32: each pair's summed log-probability of its answers'
    written tokens, differentiable under grad."""
    opts = {
        "chunked": training.chunked_cross_entropy,
        "tiles": training.chunked_ce_tiles,
        "seq_chunk": training.chunked_ce_seq_chunk,
    }
    ps = [pairs[i] for i in piece.pairs]
    if piece.shared:
        (p,) = ps
        answers = [list(p.chosen), list(p.rejected)]
        lps = shared_prefix_logprobs(decoder, list(p.prompt), answers, **opts)
    else:
        rows = [
            (list(p.prompt) + list(a), len(p.prompt)) for p in ps for a in (p.chosen, p.rejected)
        ]
        lps = sequence_logprobs(decoder, rows, **opts)
    masks = [m for p in ps for m in (p.chosen_mask, p.rejected_mask)]
    keep = [torch.tensor(m, dtype=torch.bool, device=lps[0].device) for m in masks]
    sums = torch.stack([lp[k].sum() for lp, k in zip(lps, keep, strict=True)])  # (2P,)
    return sums[0::2], sums[1::2]


@dataclass(frozen=True)
class Scored:
    """What a loss reads of a piece's pairs, (P,) each; ref_* None without a reference."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor | None
    ref_rejected: torch.Tensor | None
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


@dataclass(frozen=True)
class PairStats:
    """The per-pair statistics of a step or an evaluation, by pair index."""

    members: list[int]  # sorted
    columns: dict[str, np.ndarray]  # float64 (P,) per statistic

    @property
    def loss(self) -> float:
        return float(self.columns["loss"].mean())

    def values(self, eval_names: bool = False) -> dict[str, float]:
        """Means over the pairs, by metric name (observe/names.py)."""
        table = EVAL_NAMES if eval_names else STEP_NAMES
        out = {
            name: float(self.columns[k].mean()) for k, name in table.items() if k in self.columns
        }
        if not eval_names:
            out[names.TRAIN_LOSS] = self.loss
            out[names.PREFERENCE_PAIRS_PER_STEP] = float(len(self.members))
        return out


STEP_NAMES = {
    "loss": names.PREFERENCE_LOSS,
    "accuracy": names.PREFERENCE_ACCURACY,
    "margin": names.PREFERENCE_MARGIN,
    "chosen_reward": names.PREFERENCE_CHOSEN_REWARD,
    "rejected_reward": names.PREFERENCE_REJECTED_REWARD,
    "chosen_logps": names.PREFERENCE_CHOSEN_LOGPS,
    "rejected_logps": names.PREFERENCE_REJECTED_LOGPS,
    "nll": names.PREFERENCE_NLL,
    "log_odds": names.PREFERENCE_LOG_ODDS,
    "orpo_clamped": names.PREFERENCE_ORPO_CLAMPED,
}
EVAL_NAMES = {
    "loss": names.EVAL_PREFERENCE_LOSS,
    "accuracy": names.EVAL_ACCURACY,
    "margin": names.EVAL_MARGIN,
    "chosen_logps": names.EVAL_CHOSEN_LOGPS,
    "rejected_logps": names.EVAL_REJECTED_LOGPS,
}


def score_pairs(
    decoder,
    pairs,
    members: list[int],
    cfg,
    ref: Scores | None,
    loss_fn,
    *,
    train: bool,
    sharded: bool = False,
) -> PairStats:
    """Each pass's loss over len(members) pairs, backward when training: the passes'
    gradients sum to the gradient of the mean loss over `members`. Under torchrun each rank
    runs its share of the passes; the statistics of all of them come back on every rank.
    Under fsdp2 (`sharded`: the run's Replicas.sharded) every rank runs every pass (each
    gathers the sharded blocks, a collective every rank joins) and back-propagates the others'
    with a zero loss."""
    t = cfg.training
    parts: dict[str, list[np.ndarray]] = {}
    order: list[int] = []
    for piece, own in _passes(
        sharded, pieces_of(pairs, members, t.micro_batch, t.shared_prefix_fanout)
    ):
        chosen, rejected = score(decoder, pairs, piece, t)
        out = loss_fn(_scored(pairs, piece, chosen, rejected, ref), len(members))
        if train:
            (out.loss if own else out.loss * 0.0).backward()
        order += piece.pairs
        for k, v in _columns(out).items():
            parts.setdefault(k, []).append(v)
    if distributed.world().active and not sharded:  # every rank's pieces, rank order
        shares = distributed.gather_objects((order, parts))
        order = [i for o, _ in shares for i in o]
        parts = {k: [v for _, p in shares for v in p.get(k, [])] for k in shares[0][1]}
    back = np.argsort(order)  # pieces regroup pairs: put them back in `members` order
    columns = {k: np.concatenate(v)[back] for k, v in parts.items()}
    return PairStats(sorted(members), columns)


def _passes(sharded: bool, pieces: list[Piece]) -> list[tuple[Piece, bool]]:
    """The pieces this rank runs, each with whether it is its own: its block of them (all of
    them in one process), or under fsdp2 (`sharded`: the scoring decoder's blocks sharded)
    every piece in order, the ranks' forwards and backwards in step."""
    mine = set(distributed.share(len(pieces)))
    return [(p, k in mine) for k, p in enumerate(pieces) if sharded or k in mine]


def _scored(pairs, piece: Piece, chosen, rejected, ref: Scores | None) -> Scored:
    dev, idx = chosen.device, list(piece.pairs)

    def tensor(values) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values, dtype=np.float32), device=dev)

    return Scored(
        chosen,
        rejected,
        tensor(ref.chosen[idx]) if ref is not None else None,
        tensor(ref.rejected[idx]) if ref is not None else None,
        tensor([sum(pairs[i].chosen_mask) for i in idx]),
        tensor([sum(pairs[i].rejected_mask) for i in idx]),
    )


def _columns(out: PreferenceLossOut) -> dict[str, np.ndarray]:
    cols = {
        "loss": out.losses,
        "accuracy": out.accuracy,
        "margin": out.margin,
        "chosen_reward": out.chosen_reward,
        "rejected_reward": out.rejected_reward,
        "chosen_logps": out.chosen_logps,
        "rejected_logps": out.rejected_logps,
        "nll": out.nll,
        "log_odds": out.log_odds,
        "orpo_clamped": out.orpo_clamped,
    }
    return {k: v.detach().double().cpu().numpy() for k, v in cols.items() if v is not None}


# -- the reference -------------------------------------------------------------------------


def _reference_context(cfg, model, adapters):
    """initial: the policy as the run starts; base: its adapters off; or [reference].model."""
    if cfg.reference is None and (cfg.preference.reference or "initial") == "initial":
        return lambda: contextlib.nullcontext(None)
    return context.reference(cfg, model, adapters)


@torch.no_grad()
def reference_scores(
    cfg, model, adapters, sets: dict[str, list[TokenPair]], sharded: bool = False
) -> dict[str, Scores]:
    """Each set's reference scores, by the passes training uses; `sharded`: the policy's
    blocks are (the run's Replicas.sharded)."""
    reference = _reference_context(cfg, model, adapters)
    out = {}
    with reference() as decoder:
        scorer = decoder or model.decoder
        sharded = sharded and decoder is None  # a [reference].model is whole on every rank
        for name, pairs in sets.items():
            scores = Scores.unset(len(pairs))
            members = list(range(len(pairs)))
            fanout = cfg.training.shared_prefix_fanout
            found = []
            pieces = pieces_of(pairs, members, cfg.training.micro_batch, fanout)
            for piece, _own in _passes(sharded, pieces):
                chosen, rejected = score(scorer, pairs, piece, cfg.training)
                found.append(
                    (piece.pairs, chosen.float().cpu().numpy(), rejected.float().cpu().numpy())
                )
            shares = [found] if sharded else distributed.gather_objects(found)
            for idx, chosen, rejected in (f for s in shares for f in s):
                scores.chosen[list(idx)], scores.rejected[list(idx)] = chosen, rejected
            out[name] = scores
    return out


def encode_scores(name: str, sets: list[Scores]) -> bytes:
    """MAGIC, version 1, the number of sets, each set's length (u32 LE), then each set's
    chosen and rejected scores as float32 LE."""
    head = MAGICS[name] + struct.pack("<II", 1, len(sets))
    head += b"".join(struct.pack("<I", len(s.chosen)) for s in sets)
    body = b"".join(a.astype("<f4").tobytes() for s in sets for a in (s.chosen, s.rejected))
    return head + body


def decode_scores(name: str, data: bytes, source: str) -> list[Scores]:
    magic = MAGICS[name]
    if data[:8] != magic or struct.unpack_from("<I", data, 8)[0] != 1:
        raise CheckpointError(f"{source}: {name} is not a version 1 {magic.decode()} file")
    (count,) = struct.unpack_from("<I", data, 12)
    lengths = struct.unpack_from(f"<{count}I", data, 16)
    at, out = 16 + 4 * count, []
    for n in lengths:
        arrays = []
        for _ in range(2):
            arrays.append(np.frombuffer(data, "<f4", n, at).astype(np.float32))
            at += 4 * n
        out.append(Scores(*arrays))
    return out
