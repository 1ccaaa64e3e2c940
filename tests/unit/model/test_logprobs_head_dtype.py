"""token_nll_sum's head_dtype: float32 tiles under a bf16 decoder give the float32 loss and
gradient (bench/loss_precision.py measures bf16 tiles against them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import retrograd
from retrograd.model.logprobs import token_nll_sum


def test_float32_tiles_under_a_bf16_decoder_equal_float32(tiny_model):
    path = tiny_model("gemma3")
    f32 = retrograd.load(path, device="cpu", dtype=torch.float32)
    bf16 = retrograd.load(path, device="cpu", dtype=torch.bfloat16)
    torch.manual_seed(0)
    h = (torch.randn(21, f32.config.n_embd) * 4).requires_grad_()  # large logits: bf16 rounds
    t = torch.randint(0, f32.config.n_vocab, (21,))
    plain = F.cross_entropy(f32.decoder.head(h), t, reduction="sum")  # float32 throughout
    (g_plain,) = torch.autograd.grad(plain, h)
    tiles32 = token_nll_sum(bf16.decoder, h, t, tiles=4, head_dtype=torch.float32)
    (g32,) = torch.autograd.grad(tiles32, h)
    tiles16 = token_nll_sum(bf16.decoder, h, t, tiles=4)  # the decoder's bf16
    torch.testing.assert_close(tiles32, plain, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(g32, g_plain, rtol=1e-4, atol=1e-5)
    assert abs(tiles16.item() - plain.item()) > 1e-3  # bf16 tiles really do round
