"""LoRA targets: `auto` follows the file's attention layout (fused attn_qkv or split q, k, v)."""

from __future__ import annotations

import pytest
import torch

import retrograd
from retrograd.errors import ConfigError
from retrograd.model.arch import ARCHS, auto_targets
from retrograd.trainable.lora import attach_lora, linear_modules, resolve_targets

SPLIT = ["blk.0.attn_q", "blk.0.attn_k", "blk.0.attn_v", "blk.0.attn_output", "blk.0.ffn_up"]
FUSED = ["blk.0.attn_qkv", "blk.0.attn_output", "blk.0.ffn_up"]


def test_auto_takes_qkv_for_a_fused_file_and_q_k_v_for_a_split_one():
    llama, phi3 = ARCHS["llama"].lora_targets_auto, ARCHS["phi3"].lora_targets_auto
    assert auto_targets(FUSED, llama)[:2] == ("qkv", "o")
    assert auto_targets(SPLIT, llama) == llama
    assert auto_targets(SPLIT, phi3)[:4] == ("q", "k", "v", "o")
    assert auto_targets(FUSED, phi3) == phi3


def test_resolve_auto_on_a_fused_file_selects_attn_qkv():
    chosen = resolve_targets(FUSED, ["auto"], ("q", "k", "v", "o", "ffn_up"))
    assert chosen == FUSED
    with pytest.raises(ConfigError):  # an explicit alias still names what it names
        resolve_targets(FUSED, ["q"], ())


def test_attach_auto_on_the_tiny_fused_llama(tiny_model):
    m = retrograd.load(tiny_model("llama-qkv"), device="cpu", dtype=torch.float32)
    loras = attach_lora(m.decoder, ["auto"], 2, 4.0, seed=0)
    assert "blk.0.attn_qkv" in loras and "blk.1.attn_qkv" in loras
    assert not any(n.endswith(("attn_q", "attn_k", "attn_v")) for n in linear_modules(m.decoder))
