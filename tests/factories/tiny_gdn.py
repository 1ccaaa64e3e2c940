"""Tiny gated-delta-net models: delta-net layers beside gated full-attention layers.

Four layers with full_attention_interval 2 (delta net, attention, delta net, attention), as
llama.cpp marks them; the delta net has 2 key heads and 4 value heads of 32, so that value
heads share key heads as in the real models; attention has a partial rope (32 of 64
dimensions) and a sigmoid query gate. qwen35: interleaved M-RoPE sections, separate ssm_beta
and ssm_alpha, a dense FFN. qwen3next: plain NEOX rope, beta and alpha in one ssm_ba grouped by
key head, value heads grouped by key head, and experts with a sigmoid-gated shared expert.
qwen35moe: qwen35 with qwen3next's experts.
Registered in tiny_gguf.WRITERS on import.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from tests.factories import tiny_gguf
from tests.factories.tiny_gguf import N_EMBD, N_FF, N_VOCAB, add_tokenizer, norm_weight, rand
from tests.factories.tiny_moe import N_EXPERT, N_EXPERT_USED, N_FF_EXP, add_experts

N_LAYER, INTERVAL = 4, 2
N_HEAD, N_HEAD_KV, HEAD_DIM, N_ROT, SECTIONS = 4, 2, 64, 32, [6, 5, 5, 0]
D_STATE, N_GROUP, N_V_HEADS, D_CONV = 32, 2, 4, 4  # key/value head size, key heads, value heads
D_INNER = D_STATE * N_V_HEADS
N_FF_SHEXP = 256  # qwen3next's shared expert


def write_qwen35(path: Path, seed: int = 0, chat_template: str | None = None) -> Path:
    return _write(path, "qwen35", seed, chat_template)


def write_qwen35moe(path: Path, seed: int = 0, chat_template: str | None = None) -> Path:
    return _write(path, "qwen35moe", seed, chat_template)


def write_qwen3next(
    path: Path, seed: int = 0, chat_template: str | None = None, legacy: bool = False
) -> Path:
    """legacy: the same weights with q, k, v and z in one ssm_in, grouped by key head, as
    older converters wrote Qwen3-Next (llama.cpp still reads it)."""
    return _write(path, "qwen3next", seed, chat_template, legacy)


def _write(path: Path, arch: str, seed: int, chat_template: str | None, legacy=False) -> Path:
    rng = np.random.default_rng(seed)
    moe, sections = arch != "qwen35", arch != "qwen3next"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(N_LAYER)
    w.add_context_length(256)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(N_ROT)
    if sections:
        w.add_rope_dimension_sections(SECTIONS)
    if moe:
        w.add_expert_count(N_EXPERT)
        w.add_expert_used_count(N_EXPERT_USED)
        w.add_expert_feed_forward_length(N_FF_EXP)
        w.add_expert_shared_feed_forward_length(N_FF_SHEXP)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_ssm_conv_kernel(D_CONV)
    w.add_ssm_inner_size(D_INNER)
    w.add_ssm_state_size(D_STATE)
    w.add_ssm_time_step_rank(N_V_HEADS)
    w.add_ssm_group_count(N_GROUP)
    w.add_full_attention_interval(INTERVAL)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_tokenizer(w, chat_template)

    w.add_tensor("token_embd.weight", rand(rng, N_VOCAB, N_EMBD, scale=0.5))
    w.add_tensor("output_norm.weight", norm_weight(rng, N_EMBD))
    w.add_tensor("output.weight", rand(rng, N_VOCAB, N_EMBD))
    key_dim = D_STATE * N_GROUP
    for il in range(N_LAYER):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", norm_weight(rng, N_EMBD))
        w.add_tensor(p + "post_attention_norm.weight", norm_weight(rng, N_EMBD))
        if (il + 1) % INTERVAL != 0:  # gated delta net
            qkv = rand(rng, 2 * key_dim + D_INNER, N_EMBD)
            gate = rand(rng, D_INNER, N_EMBD)
            if legacy:
                w.add_tensor(p + "ssm_in.weight", _qkvz_grouped(qkv, gate))
            else:
                w.add_tensor(p + "attn_qkv.weight", qkv)
                w.add_tensor(p + "attn_gate.weight", gate)
            w.add_tensor(
                p + "ssm_conv1d.weight", rand(rng, 2 * key_dim + D_INNER, D_CONV, scale=0.5)
            )
            w.add_tensor(p + "ssm_dt.bias", rand(rng, N_V_HEADS, scale=1.0))
            w.add_tensor(p + "ssm_a", -np.exp(rand(rng, N_V_HEADS, scale=0.5)))
            if (
                arch == "qwen3next"
            ):  # per key head: its value heads' beta rows, then their alpha rows
                w.add_tensor(p + "ssm_ba.weight", rand(rng, 2 * N_V_HEADS, N_EMBD))
            else:
                w.add_tensor(p + "ssm_beta.weight", rand(rng, N_V_HEADS, N_EMBD))
                w.add_tensor(p + "ssm_alpha.weight", rand(rng, N_V_HEADS, N_EMBD))
            w.add_tensor(p + "ssm_norm.weight", norm_weight(rng, D_STATE))
            w.add_tensor(p + "ssm_out.weight", rand(rng, N_EMBD, D_INNER))
        else:  # full attention with a query gate: attn_q holds (query, gate) per head
            w.add_tensor(p + "attn_q.weight", rand(rng, 2 * N_HEAD * HEAD_DIM, N_EMBD))
            w.add_tensor(p + "attn_k.weight", rand(rng, N_HEAD_KV * HEAD_DIM, N_EMBD))
            w.add_tensor(p + "attn_v.weight", rand(rng, N_HEAD_KV * HEAD_DIM, N_EMBD))
            w.add_tensor(p + "attn_q_norm.weight", norm_weight(rng, HEAD_DIM))
            w.add_tensor(p + "attn_k_norm.weight", norm_weight(rng, HEAD_DIM))
            w.add_tensor(p + "attn_output.weight", rand(rng, N_EMBD, N_HEAD * HEAD_DIM))
        if moe:
            add_experts(w, rng, p, bias=False)
            w.add_tensor(p + "ffn_gate_inp_shexp.weight", rand(rng, N_EMBD))
            w.add_tensor(p + "ffn_gate_shexp.weight", rand(rng, N_FF_SHEXP, N_EMBD))
            w.add_tensor(p + "ffn_up_shexp.weight", rand(rng, N_FF_SHEXP, N_EMBD))
            w.add_tensor(p + "ffn_down_shexp.weight", rand(rng, N_EMBD, N_FF_SHEXP))
        else:
            w.add_tensor(p + "ffn_gate.weight", rand(rng, N_FF, N_EMBD))
            w.add_tensor(p + "ffn_up.weight", rand(rng, N_FF, N_EMBD))
            w.add_tensor(p + "ffn_down.weight", rand(rng, N_EMBD, N_FF))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _qkvz_grouped(qkv: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """attn_qkv rows (q, k, v) and attn_gate rows (z) -> ssm_in rows: per key head its q, its
    k, then the v and the z of its N_V_HEADS / N_GROUP value heads."""
    r, key_dim = N_V_HEADS // N_GROUP, D_STATE * N_GROUP
    q, k, v = qkv[:key_dim], qkv[key_dim : 2 * key_dim], qkv[2 * key_dim :]
    rows = []
    for hk in range(N_GROUP):
        one, many = (
            slice(hk * D_STATE, (hk + 1) * D_STATE),
            slice(hk * r * D_STATE, (hk + 1) * r * D_STATE),
        )
        rows += [q[one], k[one], v[many], gate[many]]
    return np.concatenate(rows)


tiny_gguf.WRITERS["qwen35"] = write_qwen35
tiny_gguf.WRITERS["qwen3next"] = write_qwen3next
tiny_gguf.WRITERS["qwen35moe"] = write_qwen35moe
