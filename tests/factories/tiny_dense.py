"""Tiny GGUF models of the dense attention families beyond tiny_gguf's SPECS.

granite (embedding, residual, attention and logit multipliers), olmo2 (post-norms only, q/k
norms over the whole projection), smollm3 (every 4th layer without RoPE), mistral3 (YaRN rope
and the llama 4 attention temperature) and llama with one fused attn_qkv tensor. Each writer
registers itself in tiny_gguf.WRITERS on import; llama.cpp loads every file as written here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from tests.factories import tiny_gguf
from tests.factories.tiny_gguf import (
    HEAD_DIM,
    N_EMBD,
    N_FF,
    N_HEAD,
    N_HEAD_KV,
    N_VOCAB,
    add_tokenizer,
    attention_header,
    norm_weight,
    rand,
)

Q_LEN, KV_LEN = N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM


@dataclass
class DenseSpec:
    arch: str
    n_layer: int = 2
    tied: bool = True
    pre_norms: bool = True  # attn_norm and ffn_norm (olmo2 has neither)
    post_norms: bool = False  # post_attention_norm and post_ffw_norm
    full_qk_norm: bool = False  # olmo2: one norm over all heads of q, one over k
    head_qk_norm: bool = False  # qwen3: a norm per head of q and of k
    fused_qkv: bool = False
    qkv_bias: bool = False
    split_bias: bool = False  # with fused_qkv: attn_q/k/v.bias beside attn_qkv (legacy files)
    out_bias: bool = False  # attn_output.bias
    rope_freqs: bool = False
    rope_base: float = 10000.0
    keys: Callable[[gguf.GGUFWriter], None] | None = None  # the family's own metadata


def _granite_keys(w: gguf.GGUFWriter) -> None:
    # Granite 3's values in kind: embeddings x12, sub-layer outputs x0.22, logits / 2 (8 there).
    w.add_embedding_scale(12.0)
    w.add_residual_scale(0.22)
    w.add_attention_scale(0.09)
    w.add_logit_scale(2.0)


def _mistral3_keys(w: gguf.GGUFWriter) -> None:
    # Ministral 3's scheme (YaRN factor 16, beta 32 / 1, mscale_all_dim 1, temperature 0.1)
    # with an original context of 16 tokens, so that 48 test tokens cross it and the
    # temperature steps twice.
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(16.0)
    w.add_rope_scaling_orig_ctx_len(16)
    w.add_rope_scaling_yarn_beta_fast(32.0)
    w.add_rope_scaling_yarn_beta_slow(1.0)
    w.add_rope_scaling_yarn_log_mul(1.0)
    w.add_attn_temperature_scale(0.1)


SPECS: dict[str, DenseSpec] = {
    "granite": DenseSpec("granite", out_bias=True, keys=_granite_keys),
    "olmo2": DenseSpec("olmo2", tied=False, pre_norms=False, post_norms=True, full_qk_norm=True),
    "smollm3": DenseSpec("smollm3", n_layer=4, rope_base=5e6),
    "mistral3": DenseSpec("mistral3", tied=False, rope_base=1e6, keys=_mistral3_keys),
    "llama-qkv": DenseSpec("llama", tied=False, fused_qkv=True, rope_freqs=True),
    "qwen2-qkv": DenseSpec("qwen2", fused_qkv=True, qkv_bias=True),
}


def write_dense(path: Path, name: str, seed: int = 0, chat_template: str | None = None) -> Path:
    """Write the F32 tiny model `name` (a key of SPECS) to path."""
    return write_spec(path, SPECS[name], name, seed, chat_template)


def write_spec(
    path: Path, spec: DenseSpec, name: str, seed: int = 0, chat_template: str | None = None
) -> Path:
    """Write a tiny model of any DenseSpec (variants a test builds for itself)."""
    rng = np.random.default_rng(seed)
    w = attention_header(path, spec.arch, name, spec.n_layer, 1e-5, spec.rope_base)
    w.add_rope_dimension_count(HEAD_DIM)
    if spec.keys is not None:
        spec.keys(w)
    add_tokenizer(w, chat_template)

    embd_scale = 0.5 / 12.0 if spec.arch == "granite" else 0.5
    w.add_tensor("token_embd.weight", rand(rng, N_VOCAB, N_EMBD, scale=embd_scale))
    w.add_tensor("output_norm.weight", norm_weight(rng, N_EMBD))
    if not spec.tied:
        w.add_tensor("output.weight", rand(rng, N_VOCAB, N_EMBD))
    if spec.rope_freqs:
        w.add_tensor("rope_freqs.weight", np.linspace(1.0, 8.0, HEAD_DIM // 2).astype(np.float32))
    for il in range(spec.n_layer):
        _write_layer(w, rng, spec, f"blk.{il}.")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _write_layer(w: gguf.GGUFWriter, rng: np.random.Generator, spec: DenseSpec, b: str) -> None:
    if spec.pre_norms:
        w.add_tensor(b + "attn_norm.weight", norm_weight(rng, N_EMBD))
    if spec.fused_qkv:
        w.add_tensor(b + "attn_qkv.weight", rand(rng, Q_LEN + 2 * KV_LEN, N_EMBD))
        if spec.qkv_bias and not spec.split_bias:
            w.add_tensor(b + "attn_qkv.bias", rand(rng, Q_LEN + 2 * KV_LEN, scale=0.1))
        if spec.split_bias:
            w.add_tensor(b + "attn_q.bias", rand(rng, Q_LEN, scale=0.1))
            w.add_tensor(b + "attn_k.bias", rand(rng, KV_LEN, scale=0.1))
            w.add_tensor(b + "attn_v.bias", rand(rng, KV_LEN, scale=0.1))
    else:
        w.add_tensor(b + "attn_q.weight", rand(rng, Q_LEN, N_EMBD))
        w.add_tensor(b + "attn_k.weight", rand(rng, KV_LEN, N_EMBD))
        w.add_tensor(b + "attn_v.weight", rand(rng, KV_LEN, N_EMBD))
    if spec.full_qk_norm or spec.head_qk_norm:
        q_n, k_n = (Q_LEN, KV_LEN) if spec.full_qk_norm else (HEAD_DIM, HEAD_DIM)
        w.add_tensor(b + "attn_q_norm.weight", norm_weight(rng, q_n))
        w.add_tensor(b + "attn_k_norm.weight", norm_weight(rng, k_n))
    w.add_tensor(b + "attn_output.weight", rand(rng, N_EMBD, Q_LEN))
    if spec.out_bias:
        w.add_tensor(b + "attn_output.bias", rand(rng, N_EMBD, scale=0.1))
    if spec.post_norms:
        w.add_tensor(b + "post_attention_norm.weight", norm_weight(rng, N_EMBD))
    if spec.pre_norms:
        w.add_tensor(b + "ffn_norm.weight", norm_weight(rng, N_EMBD))
    w.add_tensor(b + "ffn_gate.weight", rand(rng, N_FF, N_EMBD))
    w.add_tensor(b + "ffn_up.weight", rand(rng, N_FF, N_EMBD))
    w.add_tensor(b + "ffn_down.weight", rand(rng, N_EMBD, N_FF))
    if spec.post_norms:
        w.add_tensor(b + "post_ffw_norm.weight", norm_weight(rng, N_EMBD))


for _name in SPECS:
    tiny_gguf.WRITERS[_name] = lambda path, seed=0, chat_template=None, _n=_name: write_dense(
        path, _n, seed, chat_template
    )
