"""The streamed Llama-shaped writer (tests/factories/llama_shaped.py), at its tiny shape: the file
gguf-py reads, llama.cpp loads and computes as we do, whatever the chunk size it was written in,
and that llama.cpp's quantizer turns into Q4_K_M (the F16 file removed)."""

from __future__ import annotations

import filecmp
import math

import numpy as np
import pytest

from tests.factories import llama_shaped
from tests.oracles.llama_oracle import llama_logits, open_llama

pytestmark = pytest.mark.oracle

SHAPE = llama_shaped.SHAPES["tiny"]
TEXT = "The quick brown fox jumps over the lazy dog, twice."


@pytest.fixture(scope="module")
def f16(tmp_path_factory, llama_vendor):
    return llama_shaped.write_f16(
        tmp_path_factory.mktemp("shaped") / "tiny.gguf", SHAPE, llama_vendor
    )


def test_chunk_size_does_not_change_the_file(f16, llama_vendor, tmp_path):
    # one row a chunk (100 values < a row of 256) against 16 Mi values a chunk
    again = llama_shaped.write_f16(tmp_path / "rows.gguf", SHAPE, llama_vendor, chunk=100)
    assert filecmp.cmp(f16, again, shallow=False)
    other = llama_shaped.write_f16(tmp_path / "seed1.gguf", SHAPE, llama_vendor, seed=1)
    assert not filecmp.cmp(f16, other, shallow=False)


def test_gguf_py_reads_the_stream(f16):
    import gguf

    r = gguf.GGUFReader(f16)
    plan = llama_shaped.tensors(SHAPE)
    assert [t.name for t in r.tensors] == [name for name, _, _ in plan]
    for t, (_, dims, dtype) in zip(r.tensors, plan, strict=True):
        assert tuple(int(d) for d in reversed(t.shape)) == dims, t.name
        assert t.tensor_type == (
            gguf.GGMLQuantizationType.F16 if dtype == np.float16 else gguf.GGMLQuantizationType.F32
        )
    by_name = {t.name: t for t in r.tensors}
    up = np.asarray(by_name["blk.1.ffn_up.weight"].data, dtype=np.float32)
    assert abs(up.std() * math.sqrt(SHAPE.n_embd) - 1) < 0.02
    assert (np.asarray(by_name["blk.0.ffn_norm.weight"].data) == 1).all()
    np.testing.assert_array_equal(
        by_name["rope_freqs.weight"].data, llama_shaped.rope_factors(SHAPE)
    )
    assert len(r.fields["tokenizer.ggml.tokens"].data) == llama_shaped.N_VOCAB
    assert r.fields["tokenizer.ggml.pre"].contents() == "llama-bpe"
    assert "start_header_id" in r.fields["tokenizer.chat_template"].contents()


def test_llama_cpp_computes_what_we_compute(f16):
    import llama_cpp
    import torch

    import retrograd

    llm = open_llama(f16, n_ctx=64)
    assert llama_cpp.llama_model_n_params(llm._model.model) == SHAPE.params()
    llm.close()
    model = retrograd.load(str(f16), device="cpu", dtype=torch.float32)
    ids = model.tokenizer.tokenize(TEXT)
    assert ids[0] == 128000 and len(ids) > 8  # Llama 3's BOS, then BPE pieces
    ref = llama_logits(f16, ids)
    with torch.no_grad():
        ours = model.decoder.head(model.decoder(torch.tensor([ids])))[0].numpy()
    assert 0.5 < ref.std() < 2  # unit-sized logits: the weights' scale keeps activations sane
    np.testing.assert_allclose(ours, ref, atol=2e-2)


def test_build_quantizes_to_q4_k_m_and_removes_the_f16_file(llama_vendor, tmp_path):
    import llama_cpp

    from retrograd.gguf import GGUFFile

    out = llama_shaped.build(SHAPE, tmp_path / "tiny-q4_k_m.gguf", llama_vendor, threads=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-q4_k_m.gguf"]
    types = {t.type_name for t in GGUFFile(out).tensors.values()}
    assert {"Q4_K", "Q6_K", "F32"} <= types and "F16" not in types
    llm = open_llama(out, n_ctx=64)
    assert llama_cpp.llama_model_n_params(llm._model.model) == SHAPE.params()
    llm.eval(llm.tokenize(TEXT.encode()))
    logits = np.asarray(llm.scores[: llm.n_tokens])
    assert np.isfinite(logits).all() and 0.5 < logits.std() < 2
    llm.close()
