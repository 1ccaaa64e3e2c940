"""The log-probability primitive: chunked and tiled paths equal the plain one (values and
gradients), per token and per sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import retrograd
from retrograd.model.logprobs import (
    _frozen_head,
    sequence_logprobs,
    token_logprobs,
    token_nll_sum,
)
from retrograd.trainable.lora import attach_lora


@pytest.mark.parametrize(
    "name, cache, tiles, seq_chunk",
    [
        ("gemma3", "on", 8, 5),
        ("llama", "off", 3, 0),
        ("gemma2", "off", 7, 4),
        ("qwen3", "on", 1, 16),
        ("granite", "off", 3, 4),  # logits divided by logit_scale
        ("gemma3", "int8", 8, 5),  # tiles of the 8-bit rows against their product
        ("llama", "int8", 3, 0),
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


@pytest.mark.parametrize("cache", ["on", "off"])
def test_float32_tiles_in_a_bf16_model_are_float32_values_and_gradient(tiny_model, cache):
    """The rollout scores' float32 tiles in a bf16 model: the log-probabilities are the float32
    product's whether or not a gradient is wanted, and so is the gradient (the head is kept in
    float32 both ways, as GPU RL trainers keep it; docs/exactness.md)."""
    m = retrograd.load(tiny_model("llama"), device="cpu", dtype=torch.bfloat16, cache=cache)
    torch.manual_seed(0)
    h = torch.randn(21, m.config.n_embd, requires_grad=True)
    t = torch.randint(0, m.config.n_vocab, (21,))
    opts = {"tiles": 3, "seq_chunk": 8, "head_dtype": torch.float32}
    with torch.no_grad():
        alone = token_logprobs(m.decoder, h, t, **opts)
    lp = token_logprobs(m.decoder, h, t, **opts)
    assert torch.equal(lp.detach(), alone)  # the values do not depend on the gradient
    (g,) = torch.autograd.grad(lp.sum(), h)
    w = _frozen_head(m.decoder).dense(torch.float32)  # (n_vocab, n_embd)
    exact = F.log_softmax(h.detach() @ w.T, -1).gather(1, t[:, None])[:, 0]
    torch.testing.assert_close(alone, exact, rtol=1e-5, atol=1e-4)
    (g32,) = torch.autograd.grad(F.log_softmax(h @ w.T, -1).gather(1, t[:, None]).sum(), h)
    # float32 products: equal up to the order of float32 sums (a bf16 product would be ~1e-2)
    torch.testing.assert_close(g, g32, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("compiled", ["1", "0"])
def test_tiles_wider_than_tile_rows_are_walked_in_parts(tiny_model, monkeypatch, compiled):
    """A tile wider than TILE_ROWS is walked in parts, fused (compiled) or eagerly: same sums."""
    import retrograd.model.logprobs as ce

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


@pytest.mark.parametrize("name, tiles, seq_chunk", [("gemma3", 3, 4), ("gemma2", 2, 0)])
def test_token_logprobs_and_their_gradient_under_any_upstream_weights(
    tiny_model, name, tiles, seq_chunk
):
    """Per-token values equal log_softmax of the logits; a weighted sum of them (what a policy
    loss is) has the plain path's gradient."""
    m = retrograd.load(tiny_model(name, "MOSTLY_Q8_0"), device="cpu", dtype=torch.float32)
    torch.manual_seed(2)
    h = torch.randn(9, m.config.n_embd, requires_grad=True)
    t = torch.randint(0, m.config.n_vocab, (9,))
    w = torch.randn(9)
    plain = m.decoder.head(h).log_softmax(-1).gather(1, t[:, None])[:, 0]
    (g_plain,) = torch.autograd.grad((plain * w).sum(), h)
    tiled = token_logprobs(m.decoder, h, t, tiles=tiles, seq_chunk=seq_chunk)
    (g_tiled,) = torch.autograd.grad((tiled * w).sum(), h)
    assert tiled.shape == (9,) and tiled.dtype == torch.float32
    torch.testing.assert_close(tiled, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_tiled, g_plain, rtol=1e-4, atol=1e-5)


F32_FLOOR = 1e-5  # float32 rounding of a few layers' sums, as the other tests here allow


def _rows_together_and_alone(m, rows):
    """Log-probabilities of the rows as one right-padded batch and one by one, with each way's
    gradient for the adapter's B."""
    (lora,) = [lin.lora for lin in m.decoder.modules() if getattr(lin, "lora", None)]
    together = sequence_logprobs(m.decoder, rows, tiles=2)
    (g_together,) = torch.autograd.grad(sum(x.sum() for x in together), lora.lora_b)
    alone = [sequence_logprobs(m.decoder, [row], tiles=2)[0] for row in rows]
    (g_alone,) = torch.autograd.grad(sum(x.sum() for x in alone), lora.lora_b)
    return together, alone, g_together, g_alone


@pytest.mark.parametrize("name", ["gemma3", "llama"])
def test_sequence_logprobs_of_rows_of_different_lengths(tiny_model, name):
    """A right-padded batch scores each row as that row alone does, values and gradients, up to
    rounding (docs/exactness.md, "Batch mates"): the batch changes the shapes of the products,
    hence their summation order, never what a row attends to. llama (SiLU) stays within float32
    rounding. Gemma's float32 path looks its GELU up in llama.cpp's f16 table: a rounding-sized
    change of an input can move that output by one f16 step, twice the most the table rounds
    it, so the bound is twice the table's own effect on these rows, measured here (on an AMX
    CPU the batch moved them by 4.0e-4, beyond a float32 tolerance)."""
    m = retrograd.load(tiny_model(name), device="cpu", dtype=torch.float32)
    (lora,) = attach_lora(m.decoder, ["blk.0.attn_q"], rank=2, alpha=2.0, seed=0).values()
    with torch.no_grad():
        lora.lora_b.normal_()
    g = torch.Generator().manual_seed(3)
    rows = [
        (torch.randint(0, m.config.n_vocab, (n,), generator=g).tolist(), first)
        for n, first in [(7, 3), (12, 5), (4, 1)]
    ]
    together, alone, g_together, g_alone = _rows_together_and_alone(m, rows)
    atol, g_atol = F32_FLOOR, 1e-6
    if m.config.arch.ffn_act == "gelu_tanh":
        m.decoder.f16_gelu = False  # the smooth GELU: what the table rounds
        smooth, _, g_smooth, _ = _rows_together_and_alone(m, rows)
        m.decoder.f16_gelu = True
        table = max(
            float((a - b).abs().max().detach()) for a, b in zip(together, smooth, strict=True)
        )
        assert 0 < table < 1e-2, table  # the table does round, by a few f16 steps at most
        atol += 2 * table
        g_atol += 2 * float((g_together - g_smooth).abs().max())
    for (ids, first), a, b in zip(rows, together, alone, strict=True):
        assert a.shape == (len(ids) - first,)
        torch.testing.assert_close(a, b, rtol=F32_FLOOR, atol=atol)
    # the plain definition: the full logits of the row alone
    ids, first = rows[1]
    logits = m.decoder.head(m.decoder(torch.tensor([ids]))[0])
    want = logits.log_softmax(-1)[first - 1 : -1].gather(1, torch.tensor(ids[first:])[:, None])
    torch.testing.assert_close(together[1].detach(), want[:, 0].detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_together, g_alone, rtol=1e-4, atol=g_atol)


@pytest.mark.parametrize("name", ["gemma3", "qwen2", "lfm2", "falcon-h1"])
def test_shared_prefix_fanout_equals_rows(tiny_model, name):
    """The prompt run once for a group (formats.md §8.2) gives the rows' log-probabilities and
    the same gradient for an adapter on every layer, sliding windows included (gemma3: 8)."""
    from retrograd.model.logprobs import shared_prefix_logprobs

    m = retrograd.load(tiny_model(name), device="cpu", dtype=torch.float32)
    adapters = attach_lora(m.decoder, ["q", "k", "v", "ffn_down"], rank=2, alpha=2.0, seed=0)
    with torch.no_grad():
        for lora in adapters.values():
            lora.lora_b.normal_(std=0.05)
    params = [lo.lora_a for lo in adapters.values()] + [lo.lora_b for lo in adapters.values()]
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, m.config.n_vocab, (11,), generator=g).tolist()
    answers = [torch.randint(3, m.config.n_vocab, (n,), generator=g).tolist() for n in (6, 1, 9)]
    weights = [torch.randn(len(a), generator=g) for a in answers]
    rows = sequence_logprobs(m.decoder, [(prompt + a, len(prompt)) for a in answers], tiles=2)
    g_rows = torch.autograd.grad(
        sum((x * w).sum() for x, w in zip(rows, weights, strict=True)), params
    )
    fan = shared_prefix_logprobs(m.decoder, prompt, answers, tiles=2)
    g_fan = torch.autograd.grad(
        sum((x * w).sum() for x, w in zip(fan, weights, strict=True)), params
    )
    # float32 sums in another order (attention over prompt keys then answer keys): 1e-4
    for a, b in zip(rows, fan, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    for a, b in zip(g_rows, g_fan, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-3 * float(a.abs().max()))


def test_hidden_states_without_the_head_are_the_scored_ones(tiny_model):
    """PPO's critic features: sequence_hidden and shared_prefix_hidden give the states whose
    head gives the log-probabilities the scoring passes compute, one per answer token."""
    from retrograd.model.logprobs import (
        sequence_hidden,
        shared_prefix_hidden,
        shared_prefix_logprobs,
    )

    m = retrograd.load(tiny_model("gemma3"), device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, m.config.n_vocab, (9,), generator=g).tolist()
    answers = [torch.randint(3, m.config.n_vocab, (n,), generator=g).tolist() for n in (4, 1, 7)]
    rows = [(prompt + a, len(prompt)) for a in answers]
    with torch.no_grad():
        lps = sequence_logprobs(m.decoder, rows)
        alone = sequence_hidden(m.decoder, rows)
        shared_lps = shared_prefix_logprobs(m.decoder, prompt, answers)
        shared = shared_prefix_hidden(m.decoder, prompt, answers)
    for a, h, hs, lp, slp in zip(answers, alone, shared, lps, shared_lps, strict=True):
        assert h.shape == hs.shape == (len(a), m.config.n_embd)
        torch.testing.assert_close(hs, h, rtol=1e-3, atol=1e-3)  # sums in another order
        target = torch.tensor(a)[:, None]
        direct = m.decoder.head(h).log_softmax(-1).gather(1, target)[:, 0]
        torch.testing.assert_close(direct, lp, rtol=1e-5, atol=1e-5)
        direct = m.decoder.head(hs).log_softmax(-1).gather(1, target)[:, 0]
        torch.testing.assert_close(direct, slp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, seq_chunk", [("gemma2", 4), ("llama", 0)])
def test_ids_and_topk_logprobs_equal_the_plain_log_softmax(tiny_model, name, seq_chunk):
    """Offline distillation's two head reads: chosen ids' log-probabilities (with gradient,
    chunks recomputed in backward) and the k most likely tokens, as log_softmax gives them."""
    from retrograd.model.logprobs import ids_logprobs, topk_logprobs

    m = retrograd.load(tiny_model(name), device="cpu", dtype=torch.float32)
    torch.manual_seed(0)
    h = torch.randn(11, m.config.n_embd, requires_grad=True)
    ids = torch.randint(0, m.config.n_vocab, (11, 5))
    full = torch.log_softmax(m.decoder.head(h), -1)
    plain = full.gather(1, ids)
    (g_plain,) = torch.autograd.grad(plain.sum(), h)
    got = ids_logprobs(m.decoder, h, ids, seq_chunk=seq_chunk)
    (g_got,) = torch.autograd.grad(got.sum(), h)
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_got, g_plain, rtol=1e-4, atol=1e-5)
    top_ids, top_lps = topk_logprobs(m.decoder, h.detach(), 4, seq_chunk=seq_chunk)
    want_lps, want_ids = full.detach().topk(4, -1)
    assert torch.equal(top_ids, want_ids)
    torch.testing.assert_close(top_lps, want_lps)
