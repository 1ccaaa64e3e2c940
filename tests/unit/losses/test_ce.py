"""Chunked cross-entropy equals the plain one: loss and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import retrograd
from retrograd.losses.ce import token_nll_sum
from retrograd.trainable.lora import attach_lora


@pytest.mark.parametrize(
    "name, cache, tiles, seq_chunk",
    [
        ("gemma3", "on", 8, 5),
        ("llama", "off", 3, 0),
        ("gemma2", "off", 7, 4),
        ("qwen3", "on", 1, 16),
    ],
)
def test_tiled_head_equals_plain(tiny_model, name, cache, tiles, seq_chunk):
    m = retrograd.load(
        tiny_model(name, "MOSTLY_Q8_0"), device="cpu", dtype=torch.float32, cache=cache
    )
    torch.manual_seed(0)
    h = torch.randn(13, m.config.n_embd, requires_grad=True)
    t = torch.randint(0, m.config.n_vocab, (13,))
    plain = F.cross_entropy(m.decoder.head(h), t, reduction="sum")
    (g_plain,) = torch.autograd.grad(plain, h)
    tiled = token_nll_sum(m.decoder, h, t, chunked=True, tiles=tiles, seq_chunk=seq_chunk)
    (g_tiled,) = torch.autograd.grad(tiled, h)
    torch.testing.assert_close(tiled, plain, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(g_tiled, g_plain, rtol=1e-4, atol=1e-5)


def test_trainable_head_gets_gradients_through_chunks(tiny_model):
    m = retrograd.load(tiny_model("qwen3"), device="cpu", dtype=torch.float32)
    (lora,) = attach_lora(m.decoder, ["output"], rank=2, alpha=2.0, seed=0).values()
    with torch.no_grad():
        lora.lora_b.normal_()
    h = torch.randn(9, m.config.n_embd)
    t = torch.randint(0, m.config.n_vocab, (9,))
    plain = F.cross_entropy(m.decoder.head(h), t, reduction="sum")
    ga = torch.autograd.grad(plain, [lora.lora_a, lora.lora_b])
    chunked = token_nll_sum(m.decoder, h, t, chunked=True, seq_chunk=4)
    gb = torch.autograd.grad(chunked, [lora.lora_a, lora.lora_b])
    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-4)
    for a, b in zip(ga, gb, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_bf16_tiles_stay_close(tiny_model):
    """6 positions: padded to 16 rows for the bf16 products, the padding dropped again."""
    m = retrograd.load(tiny_model("gemma3"), device="cpu", dtype=torch.bfloat16)
    h = torch.randn(6, m.config.n_embd, requires_grad=True)
    t = torch.randint(0, m.config.n_vocab, (6,))
    plain = F.cross_entropy(m.decoder.head(h), t, reduction="sum")
    (g_plain,) = torch.autograd.grad(plain, h)
    tiled = token_nll_sum(m.decoder, h, t, tiles=4)
    (g_tiled,) = torch.autograd.grad(tiled, h)
    assert abs(tiled.item() - plain.item()) < 1e-3 * abs(plain.item())
    assert g_tiled.shape == h.shape
    torch.testing.assert_close(g_tiled, g_plain, rtol=0.02, atol=0.02 * g_plain.abs().max())


@pytest.mark.parametrize("compiled", ["1", "0"])
def test_tiles_wider_than_tile_rows_are_walked_in_parts(tiny_model, monkeypatch, compiled):
    """A tile wider than TILE_ROWS is walked in parts, fused (compiled) or eagerly: same sums."""
    import retrograd.losses.ce as ce

    monkeypatch.setenv("RETRO_COMPILE", compiled)
    m = retrograd.load(tiny_model("gemma2"), device="cpu", dtype=torch.float32)  # soft-capped
    torch.manual_seed(1)
    h = torch.randn(11, m.config.n_embd, requires_grad=True)
    t = torch.randint(0, m.config.n_vocab, (11,))
    plain = F.cross_entropy(m.decoder.head(h), t, reduction="sum")
    (g_plain,) = torch.autograd.grad(plain, h)
    monkeypatch.setattr(ce, "TILE_ROWS", 37)  # not a divisor of the vocabulary
    tiled = token_nll_sum(m.decoder, h, t, chunked=True, tiles=2)
    (g_tiled,) = torch.autograd.grad(tiled, h)
    torch.testing.assert_close(tiled, plain, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(g_tiled, g_plain, rtol=1e-4, atol=1e-5)
