"""Decoder invariants: fast paths equal slow ones, frozen weights stay frozen and unsaved."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import retrograd
from retrograd.errors import ConfigError, DeviceError
from retrograd.model.arch import ROPE_NEOX, ROPE_NORM
from retrograd.model.device import (
    configure_threads,
    cpu_has_fast_bf16,
    default_dtype,
    resolve_device,
)
from retrograd.model.kv_cache import KVCache
from retrograd.model.rope import apply_rope, rope_angles
from retrograd.trainable.lora import attach_lora

IDS = [1, 300, 301, 17, 260, 400, 401, 402, 5, 6, 90, 91, 92, 93, 94, 95, 96, 97, 98, 99]


def load(path, **kw):
    return retrograd.load(path, device="cpu", dtype=kw.pop("dtype", torch.float32), **kw)


@pytest.mark.parametrize(
    "name", ["gemma3", "llama3", "phi3", "gemma2", "granite", "olmo2", "smollm3", "mistral3"]
)
def test_cached_decoding_equals_full_recompute(tiny_model, name):
    # gemma3's tiny window is 8: decoding 20 tokens crosses it on the local layers.
    m = load(tiny_model(name))
    ids = torch.tensor([IDS])
    full = m.decoder.head(m.decoder(ids))
    cache = KVCache.empty(m.config, 1, 32, torch.float32, m.device)
    steps = [m.decoder.head(m.decoder(ids[:, :5], start=0, cache=cache))]
    for t in range(5, ids.shape[1]):
        steps.append(m.decoder.head(m.decoder(ids[:, t : t + 1], start=t, cache=cache)))
    # NOTE: llama.cpp's f16 GELU table (emulated in float32) turns reassociation noise into
    # an occasional f16 step, hence 1e-3 rather than 1e-4.
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-3, rtol=1e-3)


def test_cache_fan_out_gives_each_sequence_the_prompt(tiny_model):
    m = load(tiny_model("qwen3"))
    prompt = torch.tensor([IDS[:6]])
    cache = KVCache.empty(m.config, 1, 16, torch.float32, m.device)
    m.decoder(prompt, cache=cache)
    group = cache.expand(3)
    nxt = torch.tensor([[7], [8], [9]])
    out = m.decoder.head(m.decoder(nxt, start=6, cache=group))[:, 0]
    for i in range(3):
        ref = m.decoder.head(m.decoder(torch.cat([prompt, nxt[i : i + 1]], 1)))[0, -1]
        torch.testing.assert_close(out[i], ref, atol=1e-4, rtol=1e-4)


def test_dense_cache_on_and_off_give_identical_logits(tiny_model):
    path = tiny_model("gemma3", "MOSTLY_Q4_K_M")
    on, off = load(path, cache="on"), load(path, cache="off")
    assert on.report.cache and not off.report.cache
    assert torch.equal(on.logits(IDS), off.logits(IDS))


def lora_step(path, cache: str):
    """One float32 training step on IDS with seeded LoRA adapters on six projections: the
    model, its loss and the adapters' gradients."""
    m = load(path, cache=cache)
    ids = torch.tensor([IDS])
    loras = attach_lora(m.decoder, ["q", "k", "v", "o", "ffn_up", "ffn_down"], 4, 8.0, seed=3)
    params = [p for lora in loras.values() for p in (lora.lora_a, lora.lora_b)]
    with torch.no_grad():
        for lora in loras.values():
            lora.lora_b.normal_(0, 0.05, generator=torch.Generator().manual_seed(5))
    logits = m.decoder.head(m.decoder(ids))[0, :-1]
    loss = F.cross_entropy(logits, ids[0, 1:])
    return m, loss, torch.autograd.grad(loss, params)


def test_dense_cache_on_and_off_give_identical_gradients(tiny_model):
    """One training step's loss and LoRA gradients, bit for bit in float32: the cache holds
    the dequantized copies that every product would make again without it."""
    path = tiny_model("gemma3", "MOSTLY_Q4_K_M")
    on, on_loss, on_grads = lora_step(path, "on")
    off, off_loss, off_grads = lora_step(path, "off")
    assert on.report.cache and not off.report.cache
    assert torch.equal(on_loss, off_loss)
    assert all(torch.equal(a, b) for a, b in zip(on_grads, off_grads, strict=True))


def test_packed_group_products_equal_one_product_each(tiny_model):
    """q, k and v as one product over their weights packed by rows (the sampler's overlay)
    against a plain product per weight: bf16 bit for bit where oneDNN packs bf16; float32
    (packed in the fast context only) within float32 rounding."""
    from retrograd import compute
    from retrograd.model import frozen

    m = load(tiny_model("llama3", "MOSTLY_Q4_K_M"))
    blk = m.decoder.blk[0]
    weights = [blk.attn_q.frozen, blk.attn_k.frozen, blk.attn_v.frozen]
    x = torch.randn(5, weights[0].shape[1], generator=torch.Generator().manual_seed(2))
    dtypes = [torch.float32] + ([torch.bfloat16] if frozen._onednn(torch.bfloat16) else [])
    fast = compute.SamplingPlan().forward(True, compute.ForwardPlan())
    for dtype in dtypes:
        xd = x.to(dtype)
        cache = weights[0].cache
        with torch.no_grad():
            plain = [frozen.frozen_linear(xd, w) for w in weights]
            held = cache.n_bytes
            with compute.using(fast):
                packed = frozen.frozen_linear_group(xd, weights)
        rows = sum(w.shape[0] for w in weights)
        assert cache.n_bytes >= held + rows * x.shape[1] * xd.element_size()  # one packed copy
        for a, b in zip(packed, plain, strict=True):
            if dtype == torch.bfloat16:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bf16_path_stays_close_to_f32(tiny_model):
    path = tiny_model("llama3", "MOSTLY_Q8_0")
    f32 = load(path).logits(IDS)
    bf16 = load(path, dtype=torch.bfloat16).logits(IDS)
    assert bf16.dtype == torch.float32
    assert (f32.argmax(-1) == bf16.argmax(-1)).float().mean() >= 0.9
    assert (f32 - bf16).abs().max() < 0.05 * f32.abs().max()


def test_frozen_backward_keeps_no_dense_weight(tiny_model):
    m = load(tiny_model("llama", "MOSTLY_Q4_0"), cache="off")
    loras = attach_lora(m.decoder, ["auto"], rank=4, alpha=8.0, seed=0)
    weight_shapes = {tuple(lin.frozen.shape) for lin in _linears(m)}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        logits = m.decoder.head(m.decoder(torch.tensor([IDS])))
    dense = [t for t in saved if t.dtype.is_floating_point and tuple(t.shape) in weight_shapes]
    assert dense == [], f"dense weights kept for backward: {[tuple(t.shape) for t in dense]}"
    F.cross_entropy(logits[0, :-1], torch.tensor(IDS[1:])).backward()
    # B starts at zero, so only B's gradient is non-zero after the first backward.
    assert all(lo.lora_a.grad is not None for lo in loras.values())
    assert all(lo.lora_b.grad.abs().sum() > 0 for lo in loras.values())


def _linears(m):
    from retrograd.trainable.lora import linear_modules

    return linear_modules(m.decoder).values()


def test_frozen_linear_gradient_equals_dense_autograd(tiny_model):
    from retrograd.model.frozen import frozen_linear

    m = load(tiny_model("qwen2", "MOSTLY_Q5_K_S"), cache="off")
    frozen = m.decoder.blk[0].attn_q.frozen
    x = torch.randn(2, 3, frozen.shape[1], requires_grad=True)
    frozen_linear(x, frozen).pow(2).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    F.linear(x2, frozen.dequantize(torch.float32)).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_packed_float32_products_only_for_fast_sampling(tiny_model):
    """The fast sampling context's overlay packs float32 weights: oneDNN's f32 kernel, close
    to the plain product; the exact context's leaves float32 products plain."""
    from retrograd import compute
    from retrograd.model.frozen import frozen_linear

    m = load(tiny_model("llama", "MOSTLY_Q4_K_M"))
    weight = m.decoder.output.frozen  # 512 x 256, Q-typed
    assert weight.cache.enabled
    x = torch.randn(8, weight.shape[1])
    sampling, base = compute.SamplingPlan(), compute.ForwardPlan()
    with torch.no_grad():
        plain = frozen_linear(x, weight)
        with compute.using(sampling.forward(False, base)):
            assert torch.equal(frozen_linear(x, weight), plain)
        with compute.using(sampling.forward(True, base)):
            packed = frozen_linear(x, weight)
            one = frozen_linear(x[:1], weight)
        assert weight.cache.peek_packed(weight, torch.float32) is not None
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one, plain[:1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("style", [ROPE_NORM, ROPE_NEOX])
def test_rope_is_a_rotation_of_the_right_pairs(style):
    torch.manual_seed(0)
    x = torch.randn(1, 5, 2, 8)
    cos, sin = rope_angles(torch.arange(5), 8, 10000.0)
    out = apply_rope(x, cos, sin, style)
    idx = (
        [(2 * i, 2 * i + 1) for i in range(4)]
        if style == ROPE_NORM
        else [(i, i + 4) for i in range(4)]
    )
    for i, (a, b) in enumerate(idx):
        for p in range(5):
            theta = p * 10000.0 ** (-2 * i / 8)
            z = torch.complex(x[0, p, :, a], x[0, p, :, b]) * complex(
                math.cos(theta), math.sin(theta)
            )
            torch.testing.assert_close(out[0, p, :, a], z.real, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out[0, p, :, b], z.imag, atol=1e-5, rtol=1e-5)


def test_device_and_threads(monkeypatch):
    assert resolve_device("cpu").type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="--device gpu"):
            resolve_device("gpu")
        assert resolve_device("auto").type == "cpu"
    monkeypatch.setenv("RETRO_THREADS", "1")
    assert configure_threads(4) == 1
    monkeypatch.setenv("RETRO_THREADS", "zero")
    with pytest.raises(ConfigError, match="RETRO_THREADS"):
        configure_threads()
    monkeypatch.delenv("RETRO_THREADS")
    with pytest.raises(ConfigError, match="threads = 0"):
        configure_threads(0)
    torch.set_num_threads(2)


def test_retro_dtype_overrides_the_fast_dtype(tiny_model, monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("RETRO_DTYPE", raising=False)
    fast = torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    assert default_dtype(cpu) == fast
    monkeypatch.setenv("RETRO_DTYPE", "bfloat16")
    assert default_dtype(cpu) == torch.bfloat16
    monkeypatch.setenv("RETRO_DTYPE", "float32")
    assert default_dtype(cpu) == torch.float32
    assert retrograd.load(tiny_model("llama3"), device="cpu").dtype == torch.float32
    monkeypatch.setenv("RETRO_DTYPE", "bf16")
    assert retrograd.load(tiny_model("llama3"), device="cpu").dtype == torch.bfloat16
    monkeypatch.setenv("RETRO_DTYPE", "double")
    with pytest.raises(ConfigError, match="RETRO_DTYPE=double: must be float32"):
        default_dtype(cpu)


def test_fast_bf16_needs_the_instructions_and_the_kernels_allowed_to_use_them(monkeypatch):
    """bf16 is the CPU's default only where it has AMX or AVX512-BF16 and neither oneDNN nor
    PyTorch is held below them (`make test-avx2` holds both at AVX2)."""
    from retrograd.model import device

    for var in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "RETRO_DTYPE"):
        monkeypatch.delenv(var, raising=False)
    cpu = torch.device("cpu")
    for flags, fast in [({"avx2", "fma"}, False), ({"avx512_bf16"}, True), ({"amx_bf16"}, True)]:
        monkeypatch.setattr(device, "cpu_flags", lambda flags=flags: flags)
        assert cpu_has_fast_bf16() is fast, flags
        assert default_dtype(cpu) == (torch.bfloat16 if fast else torch.float32)
    for var, value, fast in [
        ("ONEDNN_MAX_CPU_ISA", "AVX2", False),
        ("ONEDNN_MAX_CPU_ISA", "avx512_core_vnni", False),
        ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16", True),
        ("ONEDNN_MAX_CPU_ISA", "ALL", True),
        ("ATEN_CPU_CAPABILITY", "avx2", False),
        ("ATEN_CPU_CAPABILITY", "default", False),
        ("ATEN_CPU_CAPABILITY", "avx512", True),
    ]:
        monkeypatch.setenv(var, value)
        assert cpu_has_fast_bf16() is fast, (var, value)
        assert default_dtype(cpu) == (torch.bfloat16 if fast else torch.float32)
        monkeypatch.delenv(var)


@pytest.mark.parametrize(
    "name", ["gemma3", "llama3", "phi3", "granite", "olmo2", "smollm3", "mistral3", "llama-qkv"]
)
def test_fused_bf16_block_equals_unfused(tiny_model, compute_plan, name):
    """The bf16 path's fused norms, rope and activation (compiled or eager) give the plain
    operations' loss and LoRA gradients, up to bf16 rounding."""
    m = load(tiny_model(name), dtype=torch.bfloat16)
    targets = ["qkv"] if name in ("phi3", "llama-qkv") else ["q", "k", "v"]
    loras = attach_lora(m.decoder, [*targets, "o", "ffn_up", "ffn_down"], 4, 8.0, seed=3)
    for lora in loras.values():
        with torch.no_grad():
            lora.lora_b.normal_(0, 0.05, generator=torch.Generator().manual_seed(5))
    params = [p for lora in loras.values() for p in (lora.lora_a, lora.lora_b)]
    ids = torch.tensor([IDS])

    def run(fuse: bool, compiled: bool):
        with compute_plan(fuse=fuse, compile=compiled):
            logits = m.decoder.head(m.decoder(ids))[0, :-1]
            loss = F.cross_entropy(logits, ids[0, 1:])
            grads = torch.autograd.grad(loss, params)
        return loss, grads

    plain_loss, plain_grads = run(False, False)
    for compiled in (True, False):
        loss, grads = run(True, compiled)
        assert abs(loss.item() - plain_loss.item()) < 0.02 * abs(plain_loss.item())
        for a, b in zip(grads, plain_grads, strict=True):
            assert (a - b).abs().max() <= 0.05 * b.abs().max() + 1e-6


def test_grouped_projections_equal_separate_ones(tiny_model, monkeypatch):
    """bf16 with the cache on: q/k/v and gate/up as one stacked product each, forward and
    backward, give the separate products' loss and input gradient; the stacked copies replace
    the single ones in the cache."""
    import retrograd.model.block as block_module
    import retrograd.model.decoder as decoder_module

    m = load(tiny_model("gemma3"), dtype=torch.bfloat16, cache="on")
    ids = torch.tensor([IDS])

    def run():
        m.decoder.token_embd.cache.clear()
        x = m.decoder.embed(ids).detach().requires_grad_()
        ctx = decoder_module.ForwardContext(
            m.config, ids.shape[1], 0, None, torch.bfloat16, m.device, None, False, None
        )
        h = x
        for block in m.decoder.blk:
            h = block(h, ctx)
        loss = m.decoder.output_norm(h).square().mean()
        (grad,) = torch.autograd.grad(loss, x)
        return loss, grad

    grouped_loss, grouped_grad = run()
    blk = m.decoder.blk[0]
    cache = blk.attn_q.frozen.cache
    assert cache.peek(blk.attn_q.frozen, torch.bfloat16) is None  # only the stacked copy
    monkeypatch.setattr(block_module, "frozen_linear_group", lambda x, w: None)
    plain_loss, plain_grad = run()
    assert cache.peek(blk.attn_q.frozen, torch.bfloat16) is not None
    torch.testing.assert_close(grouped_loss, plain_loss, rtol=2e-2, atol=1e-3)
    assert (grouped_grad - plain_grad).abs().max() <= 0.05 * plain_grad.abs().max()
