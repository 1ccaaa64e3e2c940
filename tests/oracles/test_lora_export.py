"""Adapters we write load in llama.cpp and give the logits our model gives with them."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import retrograd
from retrograd.errors import GGUFError
from retrograd.gguf import GGUFFile, write_lora_adapter
from tests.oracles.llama_oracle import llama_logits

pytestmark = pytest.mark.oracle

IDS = [1, 300, 301, 17, 260, 400, 401, 402, 5, 6, 90, 91, 92]
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def random_pairs(model_path, rank=4, seed=0, scale=0.1):
    """(A, B) for every projection of every block, and the head when it is its own tensor."""
    g = GGUFFile(model_path)
    names = [n for n in g.tensors if n.endswith(".weight") and n.split(".")[-2] in PROJECTIONS]
    if "output.weight" in g.tensors:
        names.append("output.weight")
    rng = np.random.default_rng(seed)
    pairs = {}
    for name in names:
        n_out, n_in = g.tensor(name).shape
        a = (rng.standard_normal((rank, n_in)) * scale).astype(np.float32)
        b = (rng.standard_normal((n_out, rank)) * scale).astype(np.float32)
        pairs[name] = (a, b)
    return g.architecture, pairs


def ours(model, adapter):
    m = retrograd.load(model, device="cpu", dtype=torch.float32, adapter=adapter)
    return m.logits(IDS).numpy()


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen2"])
def test_f32_adapter_matches_llama_cpp(tiny_model, tmp_path, name):
    model = tiny_model(name)
    arch, pairs = random_pairs(model)
    adapter = write_lora_adapter(
        tmp_path / "a.gguf", architecture=arch, tensors=pairs, alpha=8.0, dtype="f32"
    )
    ref = llama_logits(model, IDS, lora_path=str(adapter))
    assert np.abs(ref - llama_logits(model, IDS)).max() > 0.05  # the adapter changes the model
    assert np.abs(ours(model, adapter) - ref).max() < 2e-3


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_f16_adapter_matches_llama_cpp(tiny_model, tmp_path, name):
    # NOTE: with f16 factors llama.cpp's CPU matmul rounds the activations to f16 as well, an
    # error of about 1e-3 of the adapter's effect (5e-3 for an effect of 6 logits, measured);
    # factors of a trained adapter's size (effect about 2 logits here) stay within 2e-3.
    model = tiny_model(name)
    arch, pairs = random_pairs(model, rank=8, seed=1, scale=0.05)
    adapter = write_lora_adapter(tmp_path / "a.gguf", architecture=arch, tensors=pairs, alpha=16.0)
    ref = llama_logits(model, IDS, lora_path=str(adapter))
    assert np.abs(ref - llama_logits(model, IDS)).max() > 1.0
    assert np.abs(ours(model, adapter) - ref).max() < 2e-3


def test_metadata_and_layout_as_llama_cpp_expects(tiny_model, tmp_path):
    arch, pairs = random_pairs(tiny_model("llama"), rank=3)
    path = write_lora_adapter(
        tmp_path / "x.gguf", architecture=arch, tensors=pairs, alpha=6.0, name="my adapter"
    )
    r = gguf.GGUFReader(path)  # gguf-py's reader, not ours
    types = {f.name: f.types[0] for f in r.fields.values() if f.types}
    assert types["adapter.lora.alpha"] == gguf.GGUFValueType.FLOAT32
    assert types["general.quantization_version"] == gguf.GGUFValueType.UINT32
    val = {k: f.contents() for k, f in r.fields.items()}
    assert val["general.architecture"] == "llama"
    assert val["general.type"] == "adapter" and val["adapter.type"] == "lora"
    assert val["adapter.lora.alpha"] == 6.0 and val["general.name"] == "my adapter"
    tensors = {t.name: t for t in r.tensors}
    assert set(tensors) == {f"{n}.lora_{h}" for n in pairs for h in "ab"}
    a, b = pairs["blk.1.attn_q.weight"]
    ta, tb = tensors["blk.1.attn_q.weight.lora_a"], tensors["blk.1.attn_q.weight.lora_b"]
    assert tuple(ta.shape) == (a.shape[1], 3) and tuple(tb.shape) == (3, b.shape[0])  # ggml ne
    assert ta.tensor_type == gguf.GGMLQuantizationType.F16
    np.testing.assert_array_equal(ta.data, a.astype(np.float16))
    np.testing.assert_array_equal(tb.data, b.astype(np.float16))


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_our_reader_reads_back_the_factors(tiny_model, tmp_path, dtype):
    model = tiny_model("qwen2")
    arch, pairs = random_pairs(model, rank=2)
    path = write_lora_adapter(
        tmp_path / "a.gguf", architecture=arch, tensors=pairs, alpha=3.0, dtype=dtype
    )
    m = retrograd.load(model, device="cpu", dtype=torch.float32, adapter=path)
    lin = m.decoder.blk[1].ffn_down
    a, b = pairs["blk.1.ffn_down.weight"]
    cast = np.float16 if dtype == "f16" else np.float32
    np.testing.assert_array_equal(lin.lora.lora_a.detach().numpy(), a.astype(cast))
    np.testing.assert_array_equal(lin.lora.lora_b.detach().numpy(), b.astype(cast))
    assert lin.lora.scale == pytest.approx(3.0 / 2)


def pair(r=2, n_in=8, n_out=4):
    return np.ones((r, n_in), np.float32), np.ones((n_out, r), np.float32)


@pytest.mark.parametrize(
    "tensors, dtype, message",
    [
        ({"blk.0.attn_norm.weight": pair()}, "f16", "norm weights"),
        ({"token_embd.weight": pair()}, "f16", "input embedding"),
        ({"blk.0.attn_q": pair()}, "f16", "ending in .weight"),
        ({"blk.0.attn_q.weight": (np.ones((2, 8)), np.ones((4, 3)))}, "f16", "same rank"),
        ({"blk.0.attn_q.weight": pair()}, "bf16", "must be f16 or f32"),
        ({"blk.0.attn_q.weight": (np.full((2, 8), 1e6), np.ones((4, 2)))}, "f16", "overflow f16"),
        ({"blk.0.attn_q.weight": (np.full((2, 8), np.nan), np.ones((4, 2)))}, "f32", "non-finite"),
        ({}, "f16", "at least one"),
    ],
)
def test_bad_adapters_are_refused_and_nothing_is_written(tmp_path, tensors, dtype, message):
    with pytest.raises(GGUFError, match=message):
        write_lora_adapter(
            tmp_path / "a.gguf", architecture="llama", tensors=tensors, alpha=1.0, dtype=dtype
        )
    assert list(tmp_path.iterdir()) == []
