"""A tiny LFM2: short-convolution layers around an attention layer, as llama.cpp loads them."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from tests.factories import tiny_gguf as t

L_CACHE = 3  # the convolution's taps
KINDS = ("conv", "attn", "conv", "attn")  # attention layers have key/value heads


def write_lfm2(path: Path, seed: int = 0, chat_template: str | None = None) -> Path:
    rng = np.random.default_rng(seed)
    E, H, H_KV, D = t.N_EMBD, t.N_HEAD, t.N_HEAD_KV, t.HEAD_DIM
    w = gguf.GGUFWriter(str(path), "lfm2")
    w.add_name("tiny-lfm2")
    w.add_block_count(len(KINDS))
    w.add_context_length(256)
    w.add_embedding_length(E)
    w.add_feed_forward_length(t.N_FF)
    w.add_head_count(H)
    w.add_head_count_kv([H_KV if k == "attn" else 0 for k in KINDS])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(1e6)
    w.add_uint32("lfm2.shortconv.l_cache", L_CACHE)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    t.add_tokenizer(w, chat_template)
    w.add_tensor("token_embd.weight", t.rand(rng, t.N_VOCAB, E, scale=0.5))
    w.add_tensor("token_embd_norm.weight", t.norm_weight(rng, E))
    for il, kind in enumerate(KINDS):
        b = f"blk.{il}."
        w.add_tensor(b + "attn_norm.weight", t.norm_weight(rng, E))
        if kind == "attn":
            w.add_tensor(b + "attn_q.weight", t.rand(rng, H * D, E))
            w.add_tensor(b + "attn_k.weight", t.rand(rng, H_KV * D, E))
            w.add_tensor(b + "attn_v.weight", t.rand(rng, H_KV * D, E))
            w.add_tensor(b + "attn_q_norm.weight", t.norm_weight(rng, D))
            w.add_tensor(b + "attn_k_norm.weight", t.norm_weight(rng, D))
            w.add_tensor(b + "attn_output.weight", t.rand(rng, E, H * D))
        else:
            w.add_tensor(b + "shortconv.conv.weight", t.rand(rng, E, L_CACHE, scale=0.5))
            w.add_tensor(b + "shortconv.in_proj.weight", t.rand(rng, 3 * E, E))
            w.add_tensor(b + "shortconv.out_proj.weight", t.rand(rng, E, E))
        w.add_tensor(b + "ffn_norm.weight", t.norm_weight(rng, E))
        w.add_tensor(b + "ffn_gate.weight", t.rand(rng, t.N_FF, E))
        w.add_tensor(b + "ffn_up.weight", t.rand(rng, t.N_FF, E))
        w.add_tensor(b + "ffn_down.weight", t.rand(rng, E, t.N_FF))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


t.WRITERS["lfm2"] = write_lfm2
