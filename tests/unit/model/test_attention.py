"""Training attention (fused forward, matmul backward) against PyTorch's SDPA in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import retrograd.model.attention as attn


def _reference(q, k, v, mask, scale=0.2):
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    H = q.shape[1]
    o = F.scaled_dot_product_attention(
        qd, attn.repeat_kv(kd, H), attn.repeat_kv(vd, H), attn_mask=mask, scale=scale
    )
    return o, (qd, kd, vd)


def _causal(T, S):
    return torch.ones(T, S, dtype=torch.bool).tril(S - T)


@pytest.mark.parametrize(
    "B, H, H_kv, T, S, mask_kind, chunk",
    [
        (1, 4, 1, 40, 40, "causal", 1024),  # Gemma's grouping: 4 query heads per key head
        (2, 4, 2, 24, 40, "cache", 1024),  # a pass after cached keys: S > T
        (2, 2, 2, 24, 24, "padding", 1024),  # left padding, (B, 1, T, S) mask
        (2, 4, 2, 24, 40, "cache", 7),  # several query chunks
    ],
)
@pytest.mark.parametrize("compiled, keep", [("1", True), ("0", True), ("1", False)])
def test_attention_matches_sdpa(monkeypatch, B, H, H_kv, T, S, mask_kind, chunk, compiled, keep):
    """keep: probabilities kept from forward (small layers) or recomputed in backward."""
    monkeypatch.setenv("RETRO_COMPILE", compiled)
    monkeypatch.setattr(attn, "QUERY_CHUNK", chunk)
    monkeypatch.setattr(attn, "KEEP_PROBS", attn.KEEP_PROBS if keep else 0)
    g = torch.Generator().manual_seed(T + S)
    q = torch.randn(B, H, T, 16, generator=g).bfloat16().requires_grad_()
    k = torch.randn(B, H_kv, S, 16, generator=g).bfloat16().requires_grad_()
    v = torch.randn(B, H_kv, S, 16, generator=g).bfloat16().requires_grad_()
    grad = torch.randn(B, H, T, 16, generator=g).bfloat16()
    mask = None if mask_kind == "causal" else _causal(T, S)
    if mask_kind == "padding":
        mask = mask[None, None].repeat(B, 1, 1, 1)
        mask[1, :, :, :5] = False  # the second row's first 5 keys are padding
        mask[1, 0, torch.arange(5), torch.arange(5)] = True  # padding queries see themselves
    out = attn.attention(q, k, v, mask, scale=0.2)
    out.backward(grad)
    ref, leaves = _reference(q, k, v, mask if mask is not None else _causal(T, S))
    ref.backward(grad.double())
    # bf16 inputs and products: about 2^-8 relative, as SDPA's own bf16 kernels
    torch.testing.assert_close(out.double(), ref, rtol=0.02, atol=0.02)
    for mine, leaf in zip((q, k, v), leaves, strict=True):
        scale = leaf.grad.abs().max()
        assert (mine.grad.double() - leaf.grad).abs().max() < 0.02 * scale


def test_float32_keeps_sdpa():
    """float32 (the exactness path) is PyTorch's SDPA, bit for bit."""
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    assert torch.equal(attn.attention(q, k, v, None, 0.5), want)


def test_inference_is_the_training_forward():
    """Without gradients the same chunked forward runs: evaluation sees training's numbers."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 9, 16, generator=g).bfloat16()
    k, v = (torch.randn(2, 2, 9, 16, generator=g).bfloat16() for _ in range(2))
    with torch.no_grad():
        plain = attn.attention(q, k, v, None, 0.3)
    trained = attn.attention(q.requires_grad_(), k, v, None, 0.3)
    assert torch.equal(plain, trained.detach())


@pytest.mark.parametrize("padded", [False, True])
def test_fast_decode_step_matches_the_matmul_path(padded):
    """One query against the cache: the fused float32 kernel (fast sampling) stays within bf16
    rounding of the matmul path, for shared and per-sequence (padding) masks."""
    g = torch.Generator().manual_seed(4)
    B, S = 3, 11
    q = torch.randn(B, 4, 1, 32, generator=g).bfloat16()
    cache_k, cache_v = (torch.randn(B, 2, 16, 32, generator=g).bfloat16() for _ in range(2))
    k, v = cache_k[:, :, :S], cache_v[:, :, :S]  # strided rows of a larger cache, as decoding
    mask = _causal(1, S)
    if padded:
        mask = mask[None, None].repeat(B, 1, 1, 1)
        mask[0, :, :, :4] = False
    with torch.no_grad():
        plain = attn.attention(q, k, v, mask, 0.25)
        fast = attn.attention(q, k, v, mask, 0.25, fast=True)
    ref, _ = _reference(q, k, v, mask, 0.25)
    assert not torch.equal(plain, fast)  # the fused kernel ran
    torch.testing.assert_close(fast.double(), ref.detach(), rtol=0.02, atol=0.02)
    torch.testing.assert_close(fast.float(), plain.float(), rtol=0.03, atol=0.03)
