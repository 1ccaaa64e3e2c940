"""Our float32 forward equals llama.cpp's on the same weights (docs/exactness.md).

llama.cpp runs on an F32 copy of each file (its own quantizer dequantizes), with an f32 KV
cache and flash attention off; we run in float32 on the original, quantized file. Tolerances
are the measured figures with a margin; docs/exactness.md states the measurements.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import retrograd
from tests.factories.tiny_gguf import names
from tests.factories.tiny_moe import NAMES as MOE_NAMES
from tests.oracles.llama_oracle import llama_logits, open_llama

pytestmark = pytest.mark.oracle

IDS = [1] + [int(i) for i in np.random.default_rng(7).integers(3, 512, 47)]


def compare(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    return float(np.abs(ours - ref).max()), float((ours.argmax(-1) == ref.argmax(-1)).mean())


@pytest.mark.parametrize("name", names())
def test_f32_tiny_models_match_llama_cpp(tiny_model, name):
    path = tiny_model(name)
    ours = retrograd.load(path, device="cpu", dtype=torch.float32).logits(IDS).numpy()
    diff, top1 = compare(ours, llama_logits(path, IDS))
    assert top1 == 1.0
    assert diff < 2e-3, f"{name}: max |logit diff| {diff:.2e}"


QUANTS = [
    "MOSTLY_F16",
    "MOSTLY_BF16",
    "MOSTLY_Q8_0",
    "MOSTLY_Q4_0",
    "MOSTLY_Q5_1",
    "MOSTLY_Q4_K_M",
    "MOSTLY_Q5_K_S",
    "MOSTLY_Q6_K",
    "MOSTLY_Q3_K_M",
    "MOSTLY_Q2_K",
    "MOSTLY_IQ4_NL",
    "MOSTLY_IQ4_XS",
]


@pytest.mark.parametrize("ftype", QUANTS)
@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3", "phi3"])
def test_quantized_tiny_models_match_llama_cpp_on_their_f32_copy(tiny_model, name, ftype):
    quantized = tiny_model(name, ftype)
    from tests.factories.tiny_gguf import quantize

    f32 = quantize(quantized, quantized.with_name(quantized.stem + "-as-f32.gguf"), "ALL_F32")
    ours = retrograd.load(quantized, device="cpu", dtype=torch.float32).logits(IDS).numpy()
    diff, top1 = compare(ours, llama_logits(f32, IDS))
    assert top1 == 1.0
    assert diff < 2e-3, f"{name} {ftype}: max |logit diff| {diff:.2e}"


@pytest.mark.parametrize("ftype", ["MOSTLY_Q4_K_M", "MOSTLY_Q8_0", "MOSTLY_MXFP4_MOE"])
@pytest.mark.parametrize("name", MOE_NAMES)
def test_quantized_moe_models_match_llama_cpp_on_their_f32_copy(tiny_model, name, ftype):
    """Quantized 3-D expert tensors, dequantized one selected expert at a time (MXFP4: the
    released gpt-oss files' expert format)."""
    test_quantized_tiny_models_match_llama_cpp_on_their_f32_copy(tiny_model, name, ftype)


@pytest.mark.parametrize("ftype", ["MOSTLY_Q4_K_M", "MOSTLY_Q8_0"])
def test_quantized_lfm2_matches_llama_cpp_on_its_f32_copy(tiny_model, ftype):
    """Quantized short-convolution projections; the kernels stay float32 as llama.cpp keeps them."""
    test_quantized_tiny_models_match_llama_cpp_on_their_f32_copy(tiny_model, "lfm2", ftype)


def gemma_ids(path, n: int) -> list[int]:
    text = (__import__("pathlib").Path(__file__).parent.parent / "data" / "varied.txt").read_text()
    llm = open_llama(path, n_ctx=64)
    ids = llm.tokenize(text.encode(), add_bos=True)
    llm.close()
    assert len(ids) >= n
    return ids[:n]


@pytest.mark.slow
def test_gemma_f32_matches_llama_cpp_across_the_sliding_window(gemma_path, gemma_f32):
    ids = gemma_ids(gemma_f32, 590)  # past the 512-token window of the local layers
    ours = retrograd.load(gemma_path, device="cpu", dtype=torch.float32).logits(ids).numpy()
    ref = llama_logits(gemma_f32, ids)
    diff, top1 = compare(ours, ref)
    assert top1 == 1.0
    # Gemma's residual stream is large: computing attention in float64 instead moves our own
    # logits by up to 0.03, so the float32 floor is at that level (docs/exactness.md).
    assert diff < 0.1
    assert float(np.abs(ours - ref).mean()) < 5e-3


@pytest.mark.slow
def test_gemma_quantized_file_agrees_with_llama_cpp(gemma_path):
    """llama.cpp quantizes activations on the Q4_K_M file: not exact, but close (exactness.md)."""
    ids = gemma_ids(gemma_path, 590)
    ref = llama_logits(gemma_path, ids)

    def nll(logits):
        lp = torch.log_softmax(torch.as_tensor(logits[:-1]), -1)
        return float(-lp.gather(-1, torch.as_tensor(ids[1:])[:, None]).mean())

    for dtype in (torch.float32, torch.bfloat16):
        ours = retrograd.load(gemma_path, device="cpu", dtype=dtype).logits(ids).numpy()
        assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.93
        assert abs(nll(ours) - nll(ref)) < 0.02
