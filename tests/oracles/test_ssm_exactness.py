"""The state-space families past one scan chunk: 200 tokens (four chunks of the chunked scan)
in float32 against llama.cpp's walked scan, in one pass and in pieces through the cache.

test_model_exactness.py compares 48 tokens, inside the first chunk; here the state passes from
chunk to chunk and from call to call.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import retrograd
from retrograd.model.kv_cache import KVCache
from tests.oracles.llama_oracle import llama_logits

pytestmark = pytest.mark.oracle

IDS = [1] + [int(i) for i in np.random.default_rng(11).integers(3, 512, 199)]


@pytest.mark.parametrize("name", ["mamba2", "falcon-h1"])
def test_long_sequences_match_llama_cpp_in_one_pass_and_in_pieces(tiny_model, name):
    path = tiny_model(name)
    ref = llama_logits(path, IDS)
    dec = retrograd.load(path, device="cpu", dtype=torch.float32).decoder
    ids = torch.tensor([IDS])
    with torch.no_grad():
        whole = dec.head(dec(ids))[0].numpy()
        cache = KVCache.empty(dec.cfg, 1, len(IDS), torch.float32, dec.device)
        pieces = [
            dec.head(dec(ids[:, a:b], start=a, cache=cache))[0]
            for a, b in ((0, 100), (100, 101), (101, 102), (102, 200))
        ]
    for ours in (whole, torch.cat(pieces).numpy()):
        assert (ours.argmax(-1) == ref.argmax(-1)).mean() == 1.0
        diff = float(np.abs(ours - ref).max())
        assert diff < 2e-3, f"{name}: max |logit diff| {diff:.2e}"


@pytest.mark.parametrize("ftype", ["MOSTLY_BF16", "MOSTLY_Q8_0", "MOSTLY_Q4_K_M", "MOSTLY_IQ4_XS"])
@pytest.mark.parametrize("name", ["mamba2", "falcon-h1"])
def test_quantized_files_match_llama_cpp_on_their_f32_copy(tiny_model, name, ftype):
    """ssm_in and ssm_out quantized (conv kernels, A, D and norms stay F32, as the quantizer
    leaves them): we dequantize, llama.cpp runs its dequantized copy."""
    from tests.factories.tiny_gguf import quantize
    from tests.oracles.test_model_exactness import IDS as SHORT

    quantized = tiny_model(name, ftype)
    f32 = quantize(quantized, quantized.with_name(quantized.stem + "-as-f32.gguf"), "ALL_F32")
    ours = retrograd.load(quantized, device="cpu", dtype=torch.float32).logits(SHORT).numpy()
    ref = llama_logits(f32, SHORT)
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() == 1.0
    assert float(np.abs(ours - ref).max()) < 2e-3
