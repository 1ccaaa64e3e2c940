"""One rank of the FSDP2 checks (run by test_fsdp2.py under torchrun, 2 gloo ranks).

Each rank trains LoRA on its half of every batch over a decoder whose blocks are sharded by
`shard_decoder`, reducing the adapters' gradients itself (as the ddp path does); it also trains
a whole, unsharded copy on both halves with gradient accumulation 2. It writes, per rank, the
largest difference between the two adapters and the block bytes it holds between passes.

usage: fsdp2_worker.py OUT_DIR MODEL.gguf,DTYPE,CHECKPOINTING ...  (one launch, several models)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from retrograd.distributed.fsdp2 import block_bytes, local_bytes, shard_decoder
from retrograd.model.model import load
from retrograd.trainable.lora import attach_lora

STEPS, MICRO, T = 2, 2, 24  # optimizer steps; sequences per rank's micro-batch; tokens each


def batches(n_vocab: int) -> list[torch.Tensor]:
    """Each step's whole batch (2 micro-batches of MICRO sequences), the same on every rank."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, n_vocab, (2 * MICRO, T), generator=g) for _ in range(STEPS)]


def loss_of(decoder, ids: torch.Tensor) -> torch.Tensor:
    logits = decoder.head(decoder(ids[:, :-1]))  # (B, T-1, V) float32
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def build(path: str, dtype: torch.dtype, checkpointing: bool):
    model = load(path, device="cpu", dtype=dtype, cache="on")
    adapters = attach_lora(model.decoder, ["auto"], rank=4, alpha=8.0, seed=3)
    if checkpointing:
        model.decoder.enable_checkpointing(1)
    params = [p for a in adapters.values() for p in (a.lora_a, a.lora_b)]
    return model.decoder, adapters, params


def train(decoder, params, micro_batches) -> None:
    """micro_batches(step) -> this process's micro-batches of that step; mean over 2 per step."""
    opt = torch.optim.SGD(params, lr=0.5)  # linear in the gradients: no sign amplification
    for step in range(STEPS):
        opt.zero_grad()
        for ids in micro_batches(step):
            (loss_of(decoder, ids) / 2).backward()
        if dist.is_initialized() and decoder.sharded:
            for p in params:  # each rank holds one of the 2 micro-batches: sum them
                dist.all_reduce(p.grad)
        opt.step()


def check(path: str, dtype: torch.dtype, checkpointing: bool, rank: int) -> dict:
    """The sharded run against the whole one on one model; what this rank saw."""
    torch.manual_seed(0)
    ref, ref_adapters, ref_params = build(path, dtype, checkpointing)
    data = batches(ref.cfg.n_vocab)
    train(ref, ref_params, lambda s: list(data[s].split(MICRO)))

    decoder, adapters, params = build(path, dtype, checkpointing)
    whole = block_bytes(decoder)
    shard_decoder(decoder, params)
    before = local_bytes(decoder)
    train(decoder, params, lambda s: [data[s].split(MICRO)[rank]])
    worst = max(
        (getattr(adapters[n], f) - getattr(ref_adapters[n], f)).abs().max().item()
        for n in adapters
        for f in ("lora_a", "lora_b")
    )
    return {
        "worst": worst,
        "moved": max(a.lora_b.abs().max().item() for a in adapters.values()),
        "whole": whole,
        "local_before": before,
        "local_after": local_bytes(decoder),
        "cache": decoder.token_embd.cache.enabled,
    }


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for i, spec in enumerate(sys.argv[2:]):  # MODEL.gguf,DTYPE,CHECKPOINTING
        path, dtype, checkpointing = spec.split(",")
        report = check(path, getattr(torch, dtype), checkpointing == "1", rank)
        (out / f"{i}-rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
