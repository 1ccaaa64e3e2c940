"""Passes and optimizer steps over one example, as the reference defines them.

A window of at most ctx tokens runs in passes of `micro_batch` tokens; each pass attends to
the keys and values of the window's earlier passes (kept in a KV cache, as context without
gradient) and scores its own positions. `gradient_accumulation` passes make one optimizer
step; its loss is the mean over the step's trained tokens. Passes with no trained token are
context only: they run without gradient, and a group of them makes no step of its own but
goes before the next group that has trained tokens (trailing ones are dropped). A step's
window cache can be saved and restored byte for byte, so a checkpoint taken between two
steps of one window resumes exactly. Knows the decoder and the loss, not optimizers or files.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass

import msgpack
import torch

from retrograd.algorithms import duty
from retrograd.data.sft import Example
from retrograd.errors import CheckpointError, TrainingError
from retrograd.model.decoder import Decoder
from retrograd.model.kv_cache import KVCache
from retrograd.model.logprobs import token_nll_sum


@dataclass(frozen=True)
class Group:
    passes: tuple[tuple[int, int], ...]  # token ranges [start, end) of the window, in order
    n_targets: int  # trained tokens scored by these passes (> 0)

    @property
    def end(self) -> int:
        """The window position after this group: what the cache holds once it has run."""
        return self.passes[-1][1]


def groups_of(example: Example, micro_batch: int, accumulation: int) -> list[Group]:
    """The example's optimizer steps. A group of passes without a trained token joins the
    next group as its leading context; trailing ones are dropped."""
    n = len(example.ids)
    passes = [(s, min(s + micro_batch, n)) for s in range(0, n, micro_batch)]
    groups, context = [], ()
    for i in range(0, len(passes), accumulation):
        chunk = context + tuple(passes[i : i + accumulation])
        targets = sum(_n_scored(example, s, e) for s, e in chunk)
        if targets == 0:
            context = chunk
            continue
        groups.append(Group(chunk, targets))
        context = ()
    return groups


def _n_scored(example: Example, s: int, e: int) -> int:
    return sum(example.mask[p + 1] for p in range(s, min(e, len(example.ids) - 1)))


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


def _ids(decoder: Decoder, example: Example, s: int, e: int) -> torch.Tensor:
    return torch.tensor([example.ids[s:e]], dtype=torch.long, device=decoder.device)


# (decoder, hidden states of the pass's trained positions (n, n_embd), their positions in the
# example (n,), their targets (n,)) -> the summed loss of those positions: SFT's NLL by default,
# offline distillation's top-k KL (algorithms/distill_offline.py)
PassLoss = Callable[[Decoder, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def run_pass(
    decoder: Decoder,
    example: Example,
    s: int,
    e: int,
    cache: KVCache,
    opts: LossOptions,
    pass_loss: PassLoss | None = None,
) -> torch.Tensor:
    """Forward pass [s, e) into the cache; the summed loss of its trained targets (NLL unless
    `pass_loss` says otherwise)."""
    h = decoder(_ids(decoder, example, s, e), start=s, cache=cache)[0]  # (T, n_embd)
    offsets, targets = scored(example, s, e, decoder.device)
    if pass_loss is not None:
        return pass_loss(decoder, h[offsets], offsets + s, targets)
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


def backward_group(
    decoder: Decoder,
    example: Example,
    group: Group,
    cache: KVCache,
    opts: LossOptions,
    pass_loss: PassLoss | None = None,
    mine: Collection[int] | None = None,
    sharded: bool = False,
) -> float:
    """Forward and backward over the group's passes; returns the group's mean loss per trained
    token (NLL, or `pass_loss`'s). Passes without a trained token only fill the cache (no
    gradient). With `mine` (a rank's share of the passes' indices, distributed.share) the
    other passes only fill the cache too, and the return is this rank's part of the mean: the
    ranks' parts and gradients add up to the whole group's. `sharded` (the run's
    Replicas.sharded: fsdp2) runs the other passes' backward too, with a zero loss."""
    total = 0.0
    for k, (s, e) in enumerate(group.passes):
        theirs = mine is not None and k not in mine
        if _n_scored(example, s, e) == 0 or (theirs and not sharded):
            with torch.no_grad():
                decoder(_ids(decoder, example, s, e), start=s, cache=cache)
            continue
        nll = run_pass(decoder, example, s, e, cache, opts, pass_loss)
        if theirs:  # fsdp2: a backward's gathers are collectives that every rank must join
            (nll * 0.0).backward()
            continue
        (nll / group.n_targets).backward()
        total += float(nll.detach())
    return total / group.n_targets


def clip_and_step(
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float,
    lr: float,
) -> float:
    """Clip the global gradient norm, set the step's learning rate, step, clear gradients.
    A non-finite gradient norm raises TrainingError before anything is updated."""
    norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        raise TrainingError(f"the gradient norm is {norm}")
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's AdamW share: its own rate
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    duty.tick()  # [training].max_gpu_duty_cycle: rest after the step's window, on a GPU
    return norm


def checked_step(
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float,
    lr: float,
    loss: float,
    where: str,
) -> float:
    """clip_and_step after checking the loss: a non-finite loss or gradient stops the run
    before the update, with `where` (the step and what it trained on) in the message.
    Returns the gradient norm before clipping."""
    if not math.isfinite(loss):
        optimizer.zero_grad(set_to_none=True)
        raise TrainingError(f"{where}: the loss is {loss}; {DIVERGED}")
    try:
        return clip_and_step(params, optimizer, max_grad_norm, lr)
    except TrainingError as e:
        raise TrainingError(f"{where}: {e}; {DIVERGED}") from None


DIVERGED = (
    "training stopped before updating the weights (lower [training].lr, or resume from the "
    "last checkpoint)"
)


# -- the window's cache in a checkpoint ----------------------------------------------------

_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def window_bytes(cache: KVCache, length: int) -> bytes:
    """Keys and values of window positions [0, length), exactly as cached."""
    layers = [
        [_raw(k[:, :, :length]), _raw(v[:, :, :length])]
        for k, v in zip(cache.k, cache.v, strict=True)
    ]
    dtype = _DTYPES[cache.k[0].dtype]
    return msgpack.packb({"version": 1, "dtype": dtype, "length": length, "layers": layers})


def restore_window(
    data: bytes, decoder: Decoder, example: Example, dtype: torch.dtype, length: int
) -> KVCache:
    """A cache for `example` holding the saved keys and values of [0, length)."""
    saved = msgpack.unpackb(data)
    if saved.get("dtype") != _DTYPES[dtype] or saved.get("length") != length:
        raise CheckpointError(
            f"the checkpoint's window cache ({saved.get('dtype')}, {saved.get('length')} "
            f"positions) does not fit this run ({_DTYPES[dtype]}, {length} positions)"
        )
    cache = new_cache(decoder, example, dtype)
    for layer, (k, v) in enumerate(saved["layers"]):
        for buf, raw in ((cache.k[layer], k), (cache.v[layer], v)):
            part = buf[:, :, :length]
            part.copy_(torch.frombuffer(bytearray(raw), dtype=dtype).view(part.shape))
    return cache


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
