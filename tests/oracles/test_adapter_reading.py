"""Adapters written by gguf-py (not by us) apply as llama.cpp applies them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import retrograd
from retrograd.errors import GGUFError
from tests.factories.adapters import write_adapter
from tests.oracles.llama_oracle import llama_logits

pytestmark = pytest.mark.oracle

IDS = [1, 300, 301, 17, 260, 400, 401, 402, 5, 6, 90, 91, 92]


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_gguf_py_adapter_matches_llama_cpp(tiny_model, tmp_path, name):
    model = tiny_model(name)
    targets = [f"blk.{i}.{t}.weight" for i in range(2) for t in ("attn_q", "attn_v", "ffn_down")]
    adapter = write_adapter(tmp_path / "a.gguf", model, targets)
    ours = retrograd.load(model, device="cpu", dtype=torch.float32, adapter=adapter).logits(IDS)
    ref = llama_logits(model, IDS, lora_path=str(adapter))
    base = llama_logits(model, IDS)
    assert np.abs(ref - base).max() > 0.05  # the adapter changes the model
    assert np.abs(ours.numpy() - ref).max() < 2e-3


def test_adapter_equals_merged_weight(tiny_model, tmp_path):
    model = tiny_model("qwen3")
    adapter = write_adapter(tmp_path / "a.gguf", model, ["blk.1.ffn_up.weight"], rank=2, alpha=6.0)
    m = retrograd.load(model, device="cpu", dtype=torch.float32, adapter=adapter)
    lin = m.decoder.blk[1].ffn_up
    a, b = lin.lora.lora_a.detach(), lin.lora.lora_b.detach()
    x = torch.randn(3, lin.in_features)
    merged = lin.frozen.dequantize(torch.float32) + (6.0 / 2) * b @ a
    torch.testing.assert_close(lin(x), x @ merged.T, atol=1e-5, rtol=1e-5)


def test_adapter_for_another_architecture_is_refused(tiny_model, tmp_path):
    model = tiny_model("qwen3")
    adapter = write_adapter(tmp_path / "a.gguf", model, ["blk.0.attn_q.weight"], arch="llama")
    with pytest.raises(GGUFError, match="adapter for 'llama'"):
        retrograd.load(model, device="cpu", adapter=adapter)
