"""The dense families' rope scalings and switches beyond the registered tiny models, against
llama.cpp's float32 logits; and their quantized files against llama.cpp on the F32 copies.

Variants: YaRN on a llama (the generic path gpt-oss reuses), mistral3 with its own betas and
log multiplier, a linear factor with rope.scaling.attn_factor, scaling type none, granite with
rope switched off, olmo3 (olmo2 with sliding windows: no YaRN in the window layers), a fused
attn_qkv beside separate q, k and v biases (legacy files), and qwen3's per-head Q/K norms
after a fused attn_qkv.
"""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch

import retrograd
from tests.factories.tiny_dense import SPECS, DenseSpec, write_spec
from tests.factories.tiny_gguf import quantize
from tests.oracles.llama_oracle import llama_logits
from tests.oracles.test_model_exactness import IDS, compare

pytestmark = pytest.mark.oracle

# llama-cpp-python hands llama.cpp betas 32 and 1 unless told -1 ("from the model").
FILE_BETAS = dict(yarn_beta_fast=-1.0, yarn_beta_slow=-1.0)


def _keys(*setters):
    def keys(w: gguf.GGUFWriter) -> None:
        for name, value in setters:
            getattr(w, name)(value)

    return keys


def _yarn(factor: float, n_ctx_orig: int):
    return [
        ("add_rope_scaling_type", gguf.RopeScalingType.YARN),
        ("add_rope_scaling_factor", factor),
        ("add_rope_scaling_orig_ctx_len", n_ctx_orig),
    ]


VARIANTS: dict[str, tuple[DenseSpec, dict]] = {
    "llama-yarn": (DenseSpec("llama", tied=False, keys=_keys(*_yarn(8.0, 16))), {}),
    "mistral3-betas": (
        replace(
            SPECS["mistral3"],
            keys=_keys(
                *_yarn(16.0, 24),
                ("add_rope_scaling_yarn_beta_fast", 8.0),
                ("add_rope_scaling_yarn_beta_slow", 2.0),
                ("add_rope_scaling_yarn_log_mul", 0.5),
                ("add_attn_temperature_scale", 0.3),
            ),
        ),
        FILE_BETAS,
    ),
    "llama-linear-attn-factor": (
        DenseSpec(
            "llama",
            tied=False,
            keys=_keys(
                ("add_rope_scaling_type", gguf.RopeScalingType.LINEAR),
                ("add_rope_scaling_factor", 4.0),
                ("add_rope_scaling_attn_factors", 1.25),
            ),
        ),
        {},
    ),
    "llama-scaling-none": (
        DenseSpec(
            "llama",
            tied=False,
            keys=_keys(
                ("add_rope_scaling_type", gguf.RopeScalingType.NONE),
                ("add_rope_scaling_factor", 4.0),
            ),
        ),
        {},
    ),
    "granite-no-rope": (
        replace(
            SPECS["granite"],
            keys=lambda w: (SPECS["granite"].keys(w), w.add_rope_scaling_finetuned(False)),
        ),
        {},
    ),
    "qwen2-qkv-split-bias": (replace(SPECS["qwen2-qkv"], split_bias=True), {}),
    "qwen3-qkv": (DenseSpec("qwen3", tied=False, fused_qkv=True, head_qk_norm=True), {}),
    "olmo3": (
        replace(
            SPECS["olmo2"],
            n_layer=4,
            keys=_keys(("add_sliding_window", 8), *_yarn(8.0, 16)),
        ),
        {},
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rope_variants_match_llama_cpp(tmp_path, variant):
    spec, oracle_args = VARIANTS[variant]
    path = write_spec(tmp_path / f"{variant}.gguf", spec, variant)
    m = retrograd.load(path, device="cpu", dtype=torch.float32)
    diff, top1 = compare(m.logits(IDS).numpy(), llama_logits(path, IDS, **oracle_args))
    assert top1 == 1.0
    assert diff < 2e-3, f"{variant}: max |logit diff| {diff:.2e}"


def test_variants_exercise_what_they_name(tmp_path):
    """The variants' files read as intended: else the test above could pass vacuously."""

    def cfg(variant):
        spec, _ = VARIANTS[variant]
        path = write_spec(tmp_path / f"{variant}.gguf", spec, variant)
        return retrograd.load(path, device="cpu", dtype=torch.float32).config

    assert cfg("llama-yarn").yarn.ext_factor == 1.0
    m3 = cfg("mistral3-betas")
    assert (m3.yarn.beta_fast, m3.yarn.beta_slow, m3.attn_temp_floor) == (8.0, 2.0, 24)
    assert cfg("llama-linear-attn-factor").yarn.attn_factor == 1.25
    assert cfg("llama-scaling-none").rope_freq_scale == 1.0
    assert not any(cfg("granite-no-rope").layer_rope)
    olmo3 = cfg("olmo3")
    assert olmo3.swa_layers == (True, True, True, False) and olmo3.yarn.ext_factor == 1.0


@pytest.mark.parametrize("name", ["granite", "olmo2", "smollm3", "mistral3", "llama-qkv"])
def test_quantized_dense_families_match_llama_cpp_on_their_f32_copy(tiny_model, name):
    quantized = tiny_model(name, "MOSTLY_Q4_K_M")
    f32 = quantize(quantized, quantized.with_name(quantized.stem + "-as-f32.gguf"), "ALL_F32")
    ours = retrograd.load(quantized, device="cpu", dtype=torch.float32).logits(IDS).numpy()
    diff, top1 = compare(ours, llama_logits(f32, IDS))
    assert top1 == 1.0
    assert diff < 2e-3, f"{name} Q4_K_M: max |logit diff| {diff:.2e}"
    assert not np.array_equal(ours, retrograd.load(tiny_model(name)).logits(IDS).numpy())
