"""Frozen products with their adapters as one function (model/lora_product.py) against a
frozen product plus `add_lora` per linear under autograd: the same loss and gradients within
bf16 rounding, in 16-bit compute only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import retrograd
from retrograd.model import block as block_module
from retrograd.model import layers, lora_product
from retrograd.trainable.lora import attach_lora

IDS = [1, 300, 301, 17, 260, 400, 401, 402, 5, 6, 90, 91, 92, 93, 94, 95, 96, 97, 98, 99]
TARGETS = ["q", "k", "v", "o", "ffn_gate", "ffn_up", "ffn_down"]


def step(model, loras):
    """Loss and the adapters' gradients of one pass over IDS; the fused functions' sizes, in
    the order called. NOTE: the A gradients of early layers carry the input gradients of every
    later product (the fused one's in-place sum among them)."""
    ids = torch.tensor([IDS])
    params = [p for lora in loras.values() for p in (lora.lora_a, lora.lora_b)]
    calls = []
    real = lora_product._FrozenLoRA.apply

    def counted(*args):
        calls.append(len(args[1]))
        return real(*args)

    lora_product._FrozenLoRA.apply = counted
    try:
        logits = model.decoder.head(model.decoder(ids))[0, :-1]
        loss = F.cross_entropy(logits, ids[0, 1:])
        grads = torch.autograd.grad(loss, params)
    finally:
        lora_product._FrozenLoRA.apply = real
    return loss, grads, calls


def seeded(path, cache: str, dtype):
    m = retrograd.load(path, device="cpu", dtype=dtype, cache=cache)
    loras = attach_lora(m.decoder, TARGETS, 4, 8.0, seed=3)
    with torch.no_grad():
        for lora in loras.values():
            lora.lora_b.normal_(0, 0.05, generator=torch.Generator().manual_seed(5))
    return m, loras


@pytest.mark.parametrize("cache", ["on", "off"])
def test_fused_adapters_equal_autograd_ones_in_bf16(tiny_model, monkeypatch, cache):
    """Cache on: q/k/v and gate/up each one function of three and two weights, o and down one
    weight each; cache off: one weight each. Loss and every A and B gradient agree with the
    unfused path within bf16 rounding."""
    m, loras = seeded(tiny_model("llama3", "MOSTLY_Q4_K_M"), cache, torch.bfloat16)
    loss, grads, calls = step(m, loras)
    n_layer = len(m.decoder.blk)
    expect = [3, 1, 2, 1] if cache == "on" else [1] * 7
    assert calls == expect * n_layer
    monkeypatch.setattr(block_module, "fused_lora", lambda x, linears: None)
    monkeypatch.setattr(layers, "fused_lora", lambda x, linears: None)
    plain_loss, plain_grads, plain_calls = step(m, loras)
    assert plain_calls == []
    assert abs(loss.item() - plain_loss.item()) <= 0.01 * abs(plain_loss.item())
    for got, want in zip(grads, plain_grads, strict=True):
        assert want.abs().max() > 0
        assert (got.float() - want.float()).abs().max() <= 0.03 * want.abs().max()


def test_float32_never_fuses(tiny_model):
    """The exactness path keeps one frozen product and one add_lora per linear."""
    m, loras = seeded(tiny_model("llama3", "MOSTLY_Q4_K_M"), "on", torch.float32)
    _, _, calls = step(m, loras)
    assert calls == []
