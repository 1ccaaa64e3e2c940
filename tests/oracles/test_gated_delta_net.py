"""The gated delta net families (qwen35, qwen3next) past the short sequences of the shared family tests:
both forms of the recurrence against llama.cpp over several chunks, a prefill split inside a
chunk and across the convolution window, and left-padded rows long enough to be chunked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import retrograd
from retrograd.model import delta_net
from retrograd.model.decoder import ForwardContext
from retrograd.model.kv_cache import KVCache
from retrograd.sampling import Sampler
from tests.oracles.llama_oracle import llama_logits
from tests.oracles.test_model_exactness import IDS, QUANTS

pytestmark = pytest.mark.oracle

FAMILIES = ["qwen35", "qwen35moe", "qwen3next"]
LONG = [1] + [int(i) for i in np.random.default_rng(11).integers(3, 512, 199)]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("form", ["walk", "chunks"])
def test_both_forms_match_llama_cpp_over_several_chunks(tiny_model, monkeypatch, form, name):
    path = tiny_model(name)
    rule = delta_net.delta_rule if form == "walk" else delta_net.delta_rule_chunked
    monkeypatch.setattr(delta_net, "delta_rule", rule)
    monkeypatch.setattr(delta_net, "delta_rule_chunked", rule)
    ours = retrograd.load(path, device="cpu", dtype=torch.float32).logits(LONG).numpy()
    ref = llama_logits(path, LONG)
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() == 1.0
    assert np.abs(ours - ref).max() < 2e-3


@pytest.mark.parametrize("name", FAMILIES)
def test_a_prefill_in_pieces_equals_one_pass(tiny_model, name):
    """Pieces of 70, 2, 1 and 127 positions: a chunked piece, pieces shorter than the
    convolution window, a lone position; each continues from the state the last one kept."""
    m = retrograd.load(tiny_model(name), device="cpu", dtype=torch.float32)
    dec, ids = m.decoder, torch.tensor([LONG])
    with torch.no_grad():
        whole = dec.head(dec(ids))[0]
        cache = KVCache.empty(dec.cfg, 1, len(LONG), torch.float32, dec.device)
        parts, start = [], 0
        for n in (70, 2, 1, 127):
            parts.append(dec.head(dec(ids[:, start : start + n], start=start, cache=cache))[0])
            start += n
    torch.testing.assert_close(torch.cat(parts), whole, atol=2e-4, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_left_padded_rows_get_the_logits_they_get_alone(tiny_model, name):
    m = retrograd.load(tiny_model(name), device="cpu", dtype=torch.float32)
    dec = m.decoder
    rows = [LONG[:150], LONG[:90], LONG[:3]]
    with torch.no_grad():
        sampler = Sampler(dec, m.tokenizer, fast=False)
        with sampler.context():
            _, last, _ = sampler.prefill(rows, 160)
        for i, row in enumerate(rows):
            alone = dec.head(dec(torch.tensor([row])))[0, -1]
            torch.testing.assert_close(last[i].float(), alone, atol=2e-4, rtol=0)


def test_the_mixer_under_grad_takes_the_chunks_with_the_walks_values_and_gradients(
    tiny_model, monkeypatch
):
    m = retrograd.load(tiny_model("qwen35"), device="cpu", dtype=torch.float32)
    dec, block = m.decoder, m.decoder.blk[0]
    x = torch.randn(2, 40, dec.cfg.n_embd, generator=torch.Generator().manual_seed(0))

    def run():
        h = x.clone().requires_grad_()
        ctx = ForwardContext(dec.cfg, 40, 0, None, torch.float32, h.device, None, True, None)
        y = delta_net.mix(block, h, ctx)
        y.square().sum().backward()
        return y.detach(), h.grad

    called = []
    chunked = delta_net.delta_rule_chunked
    monkeypatch.setattr(delta_net, "delta_rule_chunked", lambda *a: called.append(1) or chunked(*a))
    y, grad = run()
    assert called, "under grad the mixer takes the chunked form"
    monkeypatch.setattr(delta_net, "delta_rule_chunked", delta_net.delta_rule)
    y_walk, grad_walk = run()
    torch.testing.assert_close(y, y_walk, atol=1e-5, rtol=0)
    torch.testing.assert_close(grad, grad_walk, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("ftype", QUANTS)
def test_quantized_files_match_llama_cpp_on_their_f32_copy(tiny_model, ftype, name):
    from tests.factories.tiny_gguf import quantize

    quantized = tiny_model(name, ftype)
    f32 = quantize(quantized, quantized.with_name(quantized.stem + "-as-f32.gguf"), "ALL_F32")
    ours = retrograd.load(quantized, device="cpu", dtype=torch.float32).logits(IDS).numpy()
    ref = llama_logits(f32, IDS)
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() == 1.0
    assert np.abs(ours - ref).max() < 2e-3


def test_qwen3next_legacy_fused_ssm_in_matches_llama_cpp(tmp_path):
    """Older Qwen3-Next files hold q, k, v and z in one ssm_in grouped by key head."""
    from tests.factories.tiny_gdn import write_qwen3next

    path = write_qwen3next(tmp_path / "legacy.gguf", legacy=True)
    ours = retrograd.load(path, device="cpu", dtype=torch.float32).logits(IDS).numpy()
    ref = llama_logits(path, IDS)
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() == 1.0
    assert np.abs(ours - ref).max() < 2e-3
