"""The forward passes that score an update's sampled answers, shared by the rollout loops
(GRPO, PPO, on-policy distillation, agentic GRPO): which answers go together in one pass, and their per-token
log-probabilities under a decoder (the policy, the reference or a teacher).

An answer is scored as a row (its prompt + its ids), or, with shared_prefix_fanout, several
answers of one group after one pass over their shared prompt (formats.md §8.2). A pass holds at
most `budget` tokens (micro_batch): padded rows x width, or prompt + answers x width.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from retrograd.model.logprobs import (
    sequence_hidden,
    sequence_logprobs,
    shared_prefix_hidden,
    shared_prefix_logprobs,
)
from retrograd.rollout.records import Rollout


@dataclass(frozen=True)
class Piece:
    """Answers scored in one forward: as rows (prompt + answer each), or, with
    shared_prefix_fanout, answers of one group after one pass over their shared prompt."""

    members: tuple[int, ...]  # indices into the update's trained answers
    shared: bool


def pieces(trained: list[Rollout], budget: int, fanout: bool) -> list[Piece]:
    """The update's forward passes: whole answers, at most `budget` tokens each (padded rows
    x width, or prompt + answers x width when fanned out), at least one answer a pass. With
    fan-out, a group's answers share passes where two or more fit; the rest go as rows."""
    out: list[Piece] = []
    rows: list[int] = []
    groups: dict[tuple[int, int], list[int]] = {}
    for i, r in enumerate(trained):
        groups.setdefault((r.update, r.group), []).append(i)
    for members in groups.values():
        if not fanout:
            rows += members
            continue
        prompt, cur = len(trained[members[0]].prompt.ids), []
        for i in [*members, None]:  # None: the end of the group
            width = max([trained[j].n_tokens for j in cur if i is not None] + [0])
            if i is not None:
                width = max(width, trained[i].n_tokens)
            if i is None or (cur and prompt + width * (len(cur) + 1) > budget):
                if len(cur) > 1:
                    out.append(Piece(tuple(cur), True))
                else:
                    rows += cur
                cur = []
            if i is not None:
                cur.append(i)
    rows.sort()
    for idx in row_passes([trained[i] for i in rows], budget):
        out.append(Piece(tuple(rows[i] for i in idx), False))
    return out


def row_passes(trained: list[Rollout], budget: int) -> list[list[int]]:
    """Indices of the answers of each pass of rows: padded length x rows at most `budget`
    tokens (at least one answer a pass)."""
    out, cur, width = [], [], 0
    for i, r in enumerate(trained):
        n = len(r.prompt.ids) + len(r.ids)
        if cur and max(width, n) * (len(cur) + 1) > budget:
            out.append(cur)
            cur, width = [], 0
        cur.append(i)
        width = max(width, n)
    return out + ([cur] if cur else [])


def score(decoder, trained: list[Rollout], piece: Piece, training) -> list[torch.Tensor]:
    """Per-token log-probabilities of the piece's answers (differentiable under grad)."""
    opts = {
        "chunked": training.chunked_cross_entropy,
        "tiles": training.chunked_ce_tiles,
        "seq_chunk": training.chunked_ce_seq_chunk,
    }
    answers = [trained[i] for i in piece.members]
    if piece.shared:
        prompt = list(answers[0].prompt.ids)
        return shared_prefix_logprobs(decoder, prompt, [list(r.ids) for r in answers], **opts)
    rows = [(list(r.prompt.ids) + list(r.ids), len(r.prompt.ids)) for r in answers]
    return sequence_logprobs(decoder, rows, **opts)


@torch.no_grad()
def hidden_states(decoder, trained: list[Rollout], piece: Piece) -> list[torch.Tensor]:
    """The final hidden states that `score` scores for the piece's answers, without the head's
    product and log-softmax (PPO's value-head features)."""
    answers = [trained[i] for i in piece.members]
    if piece.shared:
        prompt = list(answers[0].prompt.ids)
        return shared_prefix_hidden(decoder, prompt, [list(r.ids) for r in answers])
    rows = [(list(r.prompt.ids) + list(r.ids), len(r.prompt.ids)) for r in answers]
    return sequence_hidden(decoder, rows)


def fanout(training) -> bool:
    return training.shared_prefix_fanout != "off"


@torch.no_grad()
def frozen_logprobs(decoder_of, decoder, trained: list[Rollout], training) -> list[np.ndarray]:
    """Per-token log-probabilities of the answers under a frozen model: `decoder_of()` is a
    context giving its decoder (None: `decoder` itself, e.g. with the adapters switched off)."""
    out: list[np.ndarray | None] = [None] * len(trained)
    for piece in pieces(trained, training.micro_batch, fanout(training)):
        with decoder_of() as other:
            lps = score(other or decoder, trained, piece, training)
        for i, lp in zip(piece.members, lps, strict=True):
            out[i] = lp.numpy().astype(np.float32)
    return out


def attach_logprobs(decoder_of, decoder, answers: list[Rollout], training, field: str) -> None:
    """frozen_logprobs of the answers, set as each one's `field` (ref_logprobs,
    teacher_logprobs)."""
    for r, lp in zip(answers, frozen_logprobs(decoder_of, decoder, answers, training), strict=True):
        setattr(r, field, lp)


def padded(values: list[np.ndarray], width: int) -> torch.Tensor:
    """(len(values), width) float32, each row's values then zeros."""
    out = torch.zeros(len(values), width)
    for i, v in enumerate(values):
        out[i, : len(v)] = torch.from_numpy(np.asarray(v, dtype=np.float32))
    return out
