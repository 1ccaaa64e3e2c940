"""A decode step through the compiled graph of the block's own step equals the same step run
layer by layer."""

from __future__ import annotations

import pytest
import torch

import retrograd
import retrograd.model.decode as decode
from retrograd import compute
from retrograd.model import frozen
from retrograd.model.kv_cache import KVCache
from tests.factories.adapters import write_adapter

B, PROMPT, STEPS = 3, 7, 5  # decoding past the tiny gemma3's sliding window of 8
FAST = compute.SamplingPlan().forward(True, compute.ForwardPlan())  # the fast context's overlay
EAGER = compute.SamplingPlan().forward(True, compute.ForwardPlan(compile=False))
# The graph reads oneDNN-packed bf16 weights, which oneDNN makes only on CPUs with bf16
# instructions; elsewhere the decoder runs layer by layer (the last test here checks that).
needs_packing = pytest.mark.skipif(
    not frozen._onednn(torch.bfloat16),
    reason="the decode graph needs oneDNN's bf16 packing (AMX, AVX512-BF16 or AVX-NE-CONVERT)",
)


def _decode(
    m, ids: torch.Tensor, pad: torch.Tensor, plan=FAST
) -> tuple[list[torch.Tensor], KVCache]:
    """Prefill left-padded prompts, then decode STEPS tokens; -> hidden states of each step."""
    dec = m.decoder
    cap = PROMPT + STEPS
    slots = torch.arange(cap)
    key_mask = slots[None, :] >= pad[:, None]
    positions = (slots[None, :] - pad[:, None]).clamp_min(0)
    cache = KVCache.empty(dec.cfg, B, cap, torch.bfloat16, dec.device)
    out = []
    with torch.no_grad(), compute.using(plan):
        dec(ids[:, :PROMPT], 0, cache, key_mask[:, :PROMPT], positions[:, :PROMPT])
        for t in range(PROMPT, cap):
            h = dec(ids[:, t : t + 1], t, cache, key_mask[:, : t + 1], positions[:, t : t + 1])
            out.append(h)
    return out, cache


@needs_packing
@pytest.mark.parametrize(
    "name, adapter",
    [("gemma3", False), ("gemma3", True), ("llama3", False), ("qwen2", True), ("phi3", True)],
)
def test_decode_graph_equals_the_layer_by_layer_path(tiny_model, tmp_path, name, adapter):
    """qwen2: projection biases; phi3: fused qkv and gate-up; adapters on every projection.
    The plain twin: the same fast context without compiling (RETRO_COMPILE=0), every layer
    stepped eagerly."""
    path = tiny_model(name)
    m = retrograd.load(path, device="cpu", dtype=torch.bfloat16)
    assert m.decoder.token_embd.cache.enabled
    if adapter:
        linears = [
            f"blk.{i}.{t}.weight"
            for i in range(m.decoder.cfg.n_layer)
            for t in ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output")
            + ("ffn_gate", "ffn_up", "ffn_down")
        ]
        from retrograd.gguf import GGUFFile

        targets = [t for t in linears if t in GGUFFile(path).tensors]
        m = retrograd.load(
            path,
            device="cpu",
            dtype=torch.bfloat16,
            adapter=write_adapter(tmp_path / "a.gguf", path, targets),
        )
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, m.decoder.cfg.n_vocab, (B, PROMPT + STEPS), generator=g)
    pad = torch.tensor([0, 2, 4])

    before = decode.graph_calls
    graph, graph_cache = _decode(m, ids, pad)
    assert decode.graph_calls - before == STEPS * m.decoder.cfg.n_layer  # every step took it
    plain, plain_cache = _decode(m, ids, pad, EAGER)
    assert decode.graph_calls - before == STEPS * m.decoder.cfg.n_layer
    # the same float32 arithmetic fused differently: float32 rounding, and now and then one
    # bf16 step (2^-8 relative) where the two orders land on either side of a rounding
    pairs = list(zip(graph, plain, strict=True))
    pairs += zip(graph_cache.k + graph_cache.v, plain_cache.k + plain_cache.v, strict=True)
    for a, b in pairs:
        a, b = a.float(), b.float()
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())


@needs_packing
def test_decode_graph_is_not_used_for_exact_sampling(tiny_model):
    """Float32 compute (the exactness path) and the exact sampling context stay as they were."""
    path = tiny_model("gemma3")
    m = retrograd.load(path, device="cpu", dtype=torch.bfloat16)
    ctx = type("Ctx", (), {})()
    ctx.cache = KVCache.empty(m.decoder.cfg, 1, 4, torch.bfloat16, m.decoder.device)
    ctx.start, ctx.fuse, ctx.dtype = 2, True, torch.bfloat16
    exact = compute.SamplingPlan().forward(False, compute.ForwardPlan())
    with compute.using(exact):
        ctx.plan = exact
        assert not decode.applies(m.decoder, ctx, 1)  # the exact context
    with compute.using(FAST):
        ctx.plan = FAST
        assert decode.applies(m.decoder, ctx, 1)
        assert not decode.applies(m.decoder, ctx, 2)  # a prefill
        ctx.plan = compute.ForwardPlan(compile=False, fast_decode=True, packed=FAST.packed)
        assert not decode.applies(m.decoder, ctx, 1)  # RETRO_COMPILE=0
        ctx.plan, ctx.fuse = FAST, False  # float32 compute
        assert not decode.applies(m.decoder, ctx, 1)


def test_a_full_cache_is_refused_as_the_layer_by_layer_path_refuses_it(tiny_model):
    m = retrograd.load(tiny_model("llama3"), device="cpu", dtype=torch.bfloat16)
    cache = KVCache.empty(m.decoder.cfg, 1, 4, torch.bfloat16, m.decoder.device)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad(), compute.using(FAST):
        m.decoder(ids, 0, cache)
        with pytest.raises(ValueError, match="KV cache holds 4 positions, 5 requested"):
            m.decoder(ids[:, :1], 4, cache)


def test_without_bf16_packing_bf16_decoding_runs_layer_by_layer(tiny_model, monkeypatch):
    """A CPU whose oneDNN cannot pack bf16 weights (AVX2 only) still decodes in bf16 on
    request: nothing is packed, no graph is taken, the numbers are the plain path's."""
    monkeypatch.setattr(frozen, "_onednn", lambda dtype: dtype != torch.bfloat16)
    m = retrograd.load(tiny_model("gemma3"), device="cpu", dtype=torch.bfloat16)
    before = decode.graph_calls
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, m.decoder.cfg.n_vocab, (B, PROMPT + STEPS), generator=g)
    pad = torch.tensor([0, 2, 4])
    packed, _ = _decode(m, ids, pad)
    assert decode.graph_calls == before
    with monkeypatch.context() as mp:
        mp.setattr(frozen, "packable", lambda *a: False)
        plain, _ = _decode(m, ids, pad)
    for a, b in zip(packed, plain, strict=True):
        assert torch.equal(a, b)


@needs_packing
@pytest.mark.parametrize("name", ["gemma3", "llama3", "phi3", "qwen2"])
def test_the_decode_graph_has_no_graph_break(tiny_model, monkeypatch, name):
    """A graph break would split a layer's step into pieces with Python between them: the
    dispatch cost the graph exists to save."""
    m = retrograd.load(tiny_model(name), device="cpu", dtype=torch.bfloat16)
    seen = []
    step = decode._step
    monkeypatch.setattr(decode, "_step", lambda *a: seen.append(a) or step(*a))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, m.decoder.cfg.n_vocab, (B, PROMPT + STEPS), generator=g)
    _decode(m, ids, torch.tensor([0, 2, 4]))
    assert seen, "no decode step took the graph"
    torch._dynamo.reset()  # explain traces afresh
    explained = torch._dynamo.explain(step.eager)(*seen[-1])
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
