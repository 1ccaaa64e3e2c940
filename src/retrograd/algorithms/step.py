"""Passes and optimizer steps over one example, as the reference defines them.

A window of at most ctx tokens runs in passes of `micro_batch` tokens; each pass attends to
the keys and values of the window's earlier passes (kept in a KV cache, as context without
gradient) and scores its own positions. `gradient_accumulation` passes make one optimizer
step; its loss is the mean over the step's trained tokens. A group of passes with no trained
token makes no step. Knows the decoder and the loss, not optimizers or files.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retrograd.data.sft import Example
from retrograd.losses.ce import token_nll_sum
from retrograd.model.decoder import Decoder
from retrograd.model.kv_cache import KVCache


@dataclass(frozen=True)
class Group:
    passes: tuple[tuple[int, int], ...]  # token ranges [start, end) of the window
    n_targets: int  # trained tokens scored by these passes


def groups_of(example: Example, micro_batch: int, accumulation: int) -> list[Group]:
    """The example's optimizer-step groups, trailing groups without targets removed."""
    n = len(example.ids)
    passes = [(s, min(s + micro_batch, n)) for s in range(0, n, micro_batch)]
    groups = []
    for i in range(0, len(passes), accumulation):
        chunk = tuple(passes[i : i + accumulation])
        targets = sum(example.mask[p + 1] for s, e in chunk for p in range(s, min(e, n - 1)))
        groups.append(Group(chunk, targets))
    while groups and groups[-1].n_targets == 0:
        groups.pop()
    return groups


def scored(example: Example, s: int, e: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets within the pass, target ids) of the trained positions of pass [s, e)."""
    n = len(example.ids)
    pos = [p for p in range(s, min(e, n - 1)) if example.mask[p + 1]]
    offsets = torch.tensor([p - s for p in pos], dtype=torch.long, device=device)
    targets = torch.tensor([example.ids[p + 1] for p in pos], dtype=torch.long, device=device)
    return offsets, targets


@dataclass
class LossOptions:
    chunked: bool = True
    tiles: int = 8
    seq_chunk: int = 512


def run_pass(
    decoder: Decoder, example: Example, s: int, e: int, cache: KVCache, opts: LossOptions
) -> torch.Tensor:
    """Forward pass [s, e) into the cache; the summed NLL of its trained targets."""
    ids = torch.tensor([example.ids[s:e]], dtype=torch.long, device=decoder.device)
    h = decoder(ids, start=s, cache=cache)[0]  # (T, n_embd)
    offsets, targets = scored(example, s, e, decoder.device)
    return token_nll_sum(
        decoder,
        h[offsets],
        targets,
        chunked=opts.chunked,
        tiles=opts.tiles,
        seq_chunk=opts.seq_chunk,
    )


def new_cache(decoder: Decoder, example: Example, dtype: torch.dtype) -> KVCache:
    return KVCache.empty(decoder.cfg, 1, len(example.ids), dtype, decoder.device)


@torch.no_grad()
def prefill_groups(
    decoder: Decoder, example: Example, groups: list[Group], upto: int, cache: KVCache
) -> None:
    """Recompute the cache of groups [0, upto) without gradient (resuming inside an example)."""
    for g in groups[:upto]:
        for s, e in g.passes:
            ids = torch.tensor([example.ids[s:e]], dtype=torch.long, device=decoder.device)
            decoder(ids, start=s, cache=cache)


def backward_group(
    decoder: Decoder, example: Example, group: Group, cache: KVCache, opts: LossOptions
) -> float:
    """Forward and backward over the group's passes; returns the group's mean NLL."""
    total = 0.0
    for s, e in group.passes:
        nll = run_pass(decoder, example, s, e, cache, opts)
        (nll / group.n_targets).backward()
        total += float(nll.detach())
    return total / group.n_targets


def clip_and_step(
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float,
    lr: float,
) -> float:
    """Clip the global gradient norm, set the step's learning rate, step, clear gradients."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)
