"""[trainable] selectors against a list of tensor names, as a GGUF would give them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from retrograd.config.core import TrainableSection
from retrograd.config.selectors import select_tensors
from retrograd.errors import ConfigError

PROJ = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up", "ffn_down", "ffn_gate")


def names(n_layers: int = 4, tied: bool = False) -> list[str]:
    found = ["token_embd.weight", "output_norm.weight", "rope_freqs.weight"]
    if not tied:
        found.append("output.weight")
    for i in range(n_layers):
        found += [f"blk.{i}.{p}.weight" for p in PROJ]
        found += [f"blk.{i}.attn_norm.weight", f"blk.{i}.ffn_norm.weight", f"blk.{i}.attn_q.bias"]
    return found


def test_module_alias_layers_and_biases():
    picked = select_tensors(
        TrainableSection(modules=["attn_q"], biases=True, layers="last:2"), names()
    )
    assert set(picked.trained) == {
        "blk.2.attn_q.weight",
        "blk.3.attn_q.weight",
        "blk.2.attn_q.bias",
        "blk.3.attn_q.bias",
    }


def test_groups_patterns_and_ranges():
    ffn = select_tensors(TrainableSection(modules="ffn", layers="1..1"), names()).trained
    assert set(ffn) == {"blk.1.ffn_up.weight", "blk.1.ffn_down.weight", "blk.1.ffn_gate.weight"}
    pattern = select_tensors(TrainableSection(modules="blk.*.attn_[kv].weight"), names()).trained
    assert len(pattern) == 8


def test_norms_include_output_norm_with_the_last_layer():
    assert "output_norm.weight" in select_tensors(TrainableSection(norms=True), names()).trained
    early = select_tensors(TrainableSection(norms=True, layers="0..1"), names()).trained
    assert "output_norm.weight" not in early and len(early) == 4


def test_hybrid_biases_are_every_module_bias():
    picked = select_tensors(TrainableSection(biases=True), names(), mode="hybrid")
    assert set(picked.trained) == {f"blk.{i}.attn_q.bias" for i in range(4)}


def test_nothing_matched_is_an_error():
    with pytest.raises(
        ConfigError,
        match=r"run.toml: \[trainable\]: selects no trainable tensor.*attn_z\* matched nothing",
    ):
        select_tensors(TrainableSection(modules="attn_z*"), names())


def test_never_trained_tensors_are_excluded():
    with pytest.raises(ConfigError, match="matched only tensors never trained: token_embd.weight"):
        select_tensors(TrainableSection(modules="token_embd.*"), names())
    picked = select_tensors(TrainableSection(modules=["token_embd.*", "attn_q"]), names())
    assert ("token_embd.weight", "input embedding, never trained") in picked.excluded


def test_quantized_tensors_are_excluded_with_tensor_infos():
    infos = {n: SimpleNamespace(is_float=not n.endswith("ffn_up.weight")) for n in names(2)}
    picked = select_tensors(TrainableSection(modules="ffn"), infos)
    assert "blk.0.ffn_up.weight" not in picked.trained
    assert ("blk.0.ffn_up.weight", "quantized, never trained") in picked.excluded


def test_tied_output_head_and_layers_beyond_the_model():
    with pytest.raises(ConfigError, match=r"\[trainable\].output_head = true: the model ties"):
        select_tensors(TrainableSection(output_head=True), names(tied=True))
    assert "output.weight" in select_tensors(TrainableSection(output_head=True), names()).trained
    with pytest.raises(ConfigError, match=r'\[trainable\].layers = "0..9": the model has 4 layers'):
        select_tensors(TrainableSection(norms=True, layers="0..9"), names())
