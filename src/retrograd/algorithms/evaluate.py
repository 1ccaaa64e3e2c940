"""Evaluation and patience: loss and perplexity on trained tokens, improvement tracking."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from retrograd.data.sft import SFTDataset
from retrograd.losses.ce import token_nll_sum
from retrograd.model.decoder import Decoder


@torch.no_grad()
def sft_loss(
    decoder: Decoder, data: SFTDataset, limit: int | None = None, seq_chunk: int = 512
) -> tuple[float, int]:
    """(mean NLL over trained tokens, number of trained tokens) of the dataset."""
    total, count = 0.0, 0
    for ex in data.examples[:limit]:
        ids = torch.tensor([ex.ids], dtype=torch.long, device=decoder.device)
        h = decoder(ids)[0, :-1]  # (T - 1, n_embd)
        keep = torch.tensor(ex.mask[1:], dtype=torch.bool, device=decoder.device)
        targets = ids[0, 1:][keep]
        total += float(token_nll_sum(decoder, h[keep], targets, seq_chunk=seq_chunk))
        count += int(keep.sum())
    return (total / count if count else float("nan")), count


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))


@dataclass
class Patience:
    """Stop after `patience` evaluations without an improvement of at least `min_delta`."""

    patience: int | None
    min_delta: float = 0.0
    best: float = float("inf")
    stale: int = 0

    def update(self, loss: float) -> bool:
        """Record an evaluation; True when it improved on the best."""
        if loss < self.best - self.min_delta:
            self.best, self.stale = loss, 0
            return True
        self.stale += 1
        return False

    @property
    def stop(self) -> bool:
        return self.patience is not None and self.stale >= self.patience
