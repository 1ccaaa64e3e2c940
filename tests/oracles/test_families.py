"""Every family beyond the first six, end to end against llama.cpp: a short SFT whose adapter
llama.cpp applies as we do, greedy generation token for token, and the cache paths (prefill
in chunks, left-padded batches) equal to one pass.

The families are the tiny models the factory registers (tests/factories/tiny_*.py); their
float32 logits are compared in test_model_exactness.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import retrograd
from retrograd.cli.main import main
from retrograd.model.kv_cache import KVCache
from retrograd.sampling import Sampler, SampleRequest, SamplingParams
from tests.e2e.test_train_sft import write_run
from tests.factories.tiny_gguf import SPECS, names
from tests.oracles.llama_oracle import llama_logits, open_llama

pytestmark = pytest.mark.oracle

FAMILIES = [n for n in names() if n not in SPECS]
PROMPT = [1, 300, 301, 17, 260, 400, 401, 402, 5, 77, 78, 79]


def llama_greedy(path, prompt: list[int], n: int) -> list[int]:
    """llama.cpp's greedy continuation, one token at a time on its own cache."""
    llm = open_llama(path, n_ctx=128)
    llm.reset()
    llm.eval(prompt)
    out = []
    for _ in range(n):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(tok)
        llm.eval([tok])
    llm.close()
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_generation_equals_llama_cpp(tiny_model, name):
    path = tiny_model(name)
    m = retrograd.load(path, device="cpu", dtype=torch.float32)
    params = SamplingParams(max_new_tokens=32, temperature=0, stop_ids=frozenset())
    [[c]] = Sampler(m.decoder, m.tokenizer, fast=False).generate(
        [SampleRequest(tuple(PROMPT), params)]
    )
    assert list(c.ids) == llama_greedy(path, PROMPT, 32)


@pytest.mark.parametrize("name", FAMILIES)
def test_sft_adapter_is_applied_by_llama_cpp_as_by_us(tiny_model, tmp_path, name):
    """ctx 32 in passes of 16 tokens: the second pass starts from the first one's cache (keys,
    values and recurrent states)."""
    model = tiny_model(name)
    run = write_run(tmp_path, model, training={"epochs": 1})
    run.write_text(run.read_text().replace('["q", "v", "ffn_down"]', '["auto"]'))
    assert main(["train", str(run)]) == 0
    adapter = tmp_path / "out" / "adapter.gguf"
    ours = retrograd.load(model, device="cpu", dtype=torch.float32, adapter=adapter)
    ids = PROMPT + [90, 91, 92, 93]
    got = ours.logits(ids).numpy()
    ref = llama_logits(model, ids, lora_path=str(adapter))
    base = llama_logits(model, ids)
    assert np.abs(ref - base).max() > 1e-3, "the adapter changes the model"
    assert np.abs(got - ref).max() < 2e-3


@pytest.mark.parametrize("name", FAMILIES)
def test_chunked_prefill_and_padded_batches_equal_one_pass(tiny_model, name):
    m = retrograd.load(tiny_model(name), device="cpu", dtype=torch.float32)
    dec = m.decoder
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        whole = dec.head(dec(ids))[0]
        cache = KVCache.empty(dec.cfg, 1, 32, torch.float32, dec.device)
        a = dec.head(dec(ids[:, :5], start=0, cache=cache))[0]
        b = dec.head(dec(ids[:, 5:], start=5, cache=cache))[0]
        torch.testing.assert_close(torch.cat([a, b]), whole, atol=2e-4, rtol=0)

        short = PROMPT[:7]
        sampler = Sampler(dec, m.tokenizer, fast=False)
        with sampler.context():
            _, last, _ = sampler.prefill([PROMPT, short], 32)
        alone = dec.head(dec(torch.tensor([short])))[0, -1]
        torch.testing.assert_close(last[1].float(), alone, atol=2e-4, rtol=0)
        torch.testing.assert_close(last[0].float(), whole[-1], atol=2e-4, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_inspect_and_preflight_accept_the_family(tiny_model, name, capsys):
    path = str(tiny_model(name))
    assert main(["inspect", "--model", path]) == 0
    out = capsys.readouterr().out
    assert "layers" in out
    assert main(["preflight", "--model", path, "--strict", "--device", "cpu"]) == 0


@pytest.mark.parametrize("name", FAMILIES)
def test_an_adapter_on_every_matmul_weight_is_applied_as_llama_cpp_applies_it(
    tiny_model, tmp_path, name
):
    """Beyond `auto`: every Linear of the family (short-convolution and SSM projections,
    routers) takes an adapter that llama.cpp applies as we do."""
    from retrograd.gguf import write_lora_adapter
    from retrograd.trainable.lora import linear_modules

    model = tiny_model(name)
    m = retrograd.load(model, device="cpu", dtype=torch.float32)
    rng = np.random.default_rng(3)
    pairs = {}
    for base, lin in linear_modules(m.decoder).items():
        n_out, n_in = lin.frozen.shape
        a = (rng.standard_normal((4, n_in)) * 0.1).astype(np.float32)
        b = (rng.standard_normal((n_out, 4)) * 0.1).astype(np.float32)
        pairs[f"{base}.weight"] = (a, b)
    arch = m.gguf.architecture
    adapter = write_lora_adapter(
        tmp_path / "a.gguf", architecture=arch, tensors=pairs, alpha=8.0, dtype="f32"
    )
    ids = PROMPT
    ref = llama_logits(model, ids, lora_path=str(adapter))
    assert np.abs(ref - llama_logits(model, ids)).max() > 0.05
    got = retrograd.load(model, device="cpu", dtype=torch.float32, adapter=adapter).logits(ids)
    assert np.abs(got.numpy() - ref).max() < 2e-3


@pytest.mark.parametrize("name", ["lfm2", "qwen3moe"])
def test_grpo_trains_a_hybrid_and_a_mixture_at_the_default_passes(tmp_path, name):
    """RL on the families: sampled groups (a shared prompt fanned out, states copied), scored
    with the shared prompt run once; ctx 128 in the default passes of 32 tokens."""
    from retrograd.algorithms.grpo import run_grpo
    from retrograd.config import load_run
    from tests.e2e.test_train_grpo import CHAT_TEMPLATE, sinks
    from tests.e2e.test_train_grpo import write_run as grpo_run
    from tests.factories.tiny_gguf import write_tiny

    model = write_tiny(tmp_path / f"{name}.gguf", name, chat_template=CHAT_TEMPLATE)
    run = grpo_run(
        tmp_path,
        model,
        {"updates": 2, "group_size": 4},
        training={"ctx": 128, "micro_batch": None, "gradient_accumulation": None},
    )
    result = run_grpo(load_run(run), run_file=run, sinks=sinks())
    assert len(result.curve) == 2 and all(np.isfinite(result.curve))
    assert (tmp_path / "out" / "adapter.gguf").exists()
