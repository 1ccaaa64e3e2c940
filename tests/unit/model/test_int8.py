"""The 8-bit weight store: its rows hold the weight within half a step, its products (forward
and the input gradient derived as (g * scale) @ q) equal the float product over the same
8-bit weight, and a model kept in 8 bits stays within a stated distance of the plain path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import retrograd
from retrograd.compute import WeightsPlan
from retrograd.model import int8, loader
from retrograd.model.int8 import int8_linear, quantize_rows
from retrograd.sampling import Sampler, SampleRequest, SamplingParams
from tests.unit.model.test_decoder import IDS, lora_step


def weight(n_out=96, n_in=64, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_out, n_in, generator=g) * torch.rand(n_out, 1, generator=g)
    w[3] = 0  # a row of zeros
    return w


def test_rows_hold_the_weight_within_half_a_step_with_bf16_scales():
    w = weight()
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert torch.equal(scale, scale.to(torch.bfloat16).float())  # every kernel reads it alike
    assert (scale[w.abs().amax(1) > 0] >= w.abs().amax(1)[w.abs().amax(1) > 0] / 127).all()
    assert scale[3] == 1 and (q[3] == 0).all()
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-6)).all()
    assert q.abs().amax(1)[w.abs().amax(1) > 0].min() >= 126  # the range is used


def test_products_and_input_gradient_equal_the_float_product_of_the_8bit_weight():
    """float64: x @ (q * s)^T and its input gradient g @ (q * s), against autograd through the
    dense 8-bit weight, to float64 rounding (the derivation W8 = diag(s) q)."""
    q, scale = quantize_rows(weight())
    w8 = q.double() * scale.double()[:, None]
    x = torch.randn(5, 7, 64, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, 7, 96, dtype=torch.float64)
    (dx,) = torch.autograd.grad(int8_linear(x, q, scale), x, g)
    (ref_dx,) = torch.autograd.grad(F.linear(x, w8), x, g)
    torch.testing.assert_close(int8_linear(x, q, scale), F.linear(x, w8), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rows", [4, 64])  # torch's int8 kernel, then q converted to bf16
def test_bf16_products_stay_within_bf16_rounding_of_the_float_product(rows):
    q, scale = quantize_rows(weight(256, 128))
    w8 = q.float() * scale[:, None]
    x = torch.randn(rows, 128)
    ref = x.bfloat16().float() @ w8.T
    assert (rows <= int8.KERNEL_ROWS) == (rows == 4)
    out = int8_linear(x.bfloat16(), q, scale).float()
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    xb = x.bfloat16().requires_grad_()
    g = torch.randn(rows, 256).bfloat16()
    (dx,) = torch.autograd.grad(int8_linear(xb, q, scale), xb, g)
    ref_dx = g.float() @ w8
    torch.testing.assert_close(dx.float(), ref_dx, rtol=2e-2, atol=2e-2 * ref_dx.abs().max())


def load(path, cache):
    return retrograd.load(path, device="cpu", dtype=torch.float32, cache=cache)


def test_a_model_kept_in_8_bits_stays_close_to_the_plain_path_and_holds_no_dense_copy(
    tiny_model,
):
    """Logits of the tiny Q4_K_M gemma3 (a tied head): the 8-bit store against the file's
    weights dequantized at each use, float32 compute. Measured: mean |difference| 1.6% of the
    logits' spread, largest 9%; the bounds are twice that. A store that read the wrong rows or
    scales misses them by far."""
    path = tiny_model("gemma3", "MOSTLY_Q4_K_M")
    off, kept = load(path, "off"), load(path, "int8")
    assert kept.report.int8_bytes > 0 and "kept in 8 bits" in kept.report.describe()
    assert "products int8" in kept.report.lines()[0]
    a, b = off.logits(IDS), kept.logits(IDS)
    assert not torch.equal(a, b)  # the 8-bit rows are what the products read
    assert (a - b).abs().mean() < 0.03 * a.std() and (a - b).abs().max() < 0.2 * a.std()
    cache = kept.decoder.token_embd.cache
    assert cache._store == {} and len(cache._int8) > 0  # 8-bit rows only, no dense copy
    params = SamplingParams(max_new_tokens=6, stop_ids=frozenset(), temperature=0)
    Sampler(kept.decoder, kept.tokenizer, fast=True).generate([SampleRequest((1, 300, 5), params)])
    assert cache._store == {}  # the sampler packs no copies beside the store


def test_8_bit_lora_gradients_stay_close_to_the_plain_path(tiny_model):
    """One step's loss and LoRA gradients with the store against the plain path (float32)."""
    path = tiny_model("llama3", "MOSTLY_Q4_K_M")
    _, ref_loss, ref_grads = lora_step(path, "off")
    _, loss, grads = lora_step(path, "int8")
    assert loss != ref_loss and abs(loss - ref_loss) < 2e-3 * ref_loss
    for a, b in zip(ref_grads, grads, strict=True):
        torch.testing.assert_close(b, a, rtol=0.05, atol=0.05 * a.abs().max().item())


def test_auto_keeps_8_bit_rows_where_the_dense_cache_does_not_fit(monkeypatch):
    gib = 1 << 30
    monkeypatch.setattr(loader, "available_memory", lambda device: 10 * gib)
    cpu = torch.device("cpu")
    auto = WeightsPlan()
    assert loader.decide_cache(3 * gib, cpu, auto, int8_bytes=2 * gib)[0] == "on"
    mode, why = loader.decide_cache(5 * gib, cpu, auto, int8_bytes=5 * gib)
    assert mode == "int8" and "8-bit does" in why
    assert loader.decide_cache(16 * gib, cpu, auto, int8_bytes=8 * gib)[0] == "off"
    asked = WeightsPlan(cache="int8")
    assert loader.decide_cache(gib, cpu, asked, "RETRO_DEQUANT_CACHE=int8") == (
        "int8",
        "RETRO_DEQUANT_CACHE=int8",
    )


def test_released_pages_of_the_file_map_read_back_the_same_bytes(tmp_path):
    """After quantizing, the store drops the weight's pages of the file map from the resident
    set (MADV_DONTNEED): reading them again maps the file's bytes, not zeros."""
    import mmap
    import warnings

    import numpy as np

    from retrograd.model.frozen import release_pages

    data = np.random.default_rng(0).integers(1, 255, 64 * 4096 + 100, dtype=np.uint8)
    (tmp_path / "w.bin").write_bytes(data.tobytes())
    with open(tmp_path / "w.bin", "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():  # read-only, as the loader's map (never written)
        warnings.simplefilter("ignore", UserWarning)
        view = torch.from_numpy(np.frombuffer(mapped, dtype=np.uint8, offset=50))
    assert int(view.sum()) == int(data[50:].astype(np.int64).sum())
    release_pages(view)
    assert torch.equal(view, torch.from_numpy(data[50:].copy()))


def test_the_loader_marks_only_the_file_map_for_release(tiny_model):
    m = load(tiny_model("llama3", "MOSTLY_Q4_K_M"), "int8")
    f = m.decoder.blk[0].attn_q.frozen
    assert f._mapped and not f.to(torch.device("cpu"))._mapped


def test_stacked_8_bit_products_equal_one_product_each_and_hold_nothing_twice(tiny_model):
    """q, k, v as one product over their stacked 8-bit rows (bf16 compute) against one
    product each; each weight's rows are then views of the stack."""
    from retrograd.model.frozen import frozen_linear_group

    m = retrograd.load(tiny_model("llama3", "MOSTLY_Q4_K_M"), device="cpu", cache="int8")
    blk = m.decoder.blk[0]
    weights = [blk.attn_q.frozen, blk.attn_k.frozen, blk.attn_v.frozen]
    cache = weights[0].cache
    x = torch.randn(2, 40, weights[0].shape[1]).bfloat16()
    alone = [int8_linear(x, *cache.int8_of(w)) for w in weights]
    held = cache.n_bytes
    together = frozen_linear_group(x, weights)
    assert cache.n_bytes == held  # the singles now view the stack
    for a, b in zip(alone, together, strict=True):
        torch.testing.assert_close(b.float(), a.float(), rtol=1e-2, atol=1e-2 * a.abs().max())
    q, _ = cache.int8_stacked(weights)
    assert (
        cache.int8_of(weights[1])[0].untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
    )
