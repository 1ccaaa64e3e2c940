"""Tiny state-space models: mamba2 (SSM layers only) and falcon-h1 (attention and SSM in parallel).

Both have a Mamba-2 mixer with head dim 32 and d_state 16: mamba2 with 2 groups of B/C, a
gated grouped RMSNorm and no FFN; falcon-h1 with 1 group, no ssm_norm (as the released models),
GQA attention beside it and a dense FFN. Falcon-H1's multipliers live in its weights (the
converter folds them in), so the file has none. dt biases and A are drawn in the ranges the
real models use, so that the recurrence neither forgets at once nor never. Registered in
tiny_gguf.WRITERS on import; llama.cpp loads both files as written here.
"""

from __future__ import annotations

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
    norm_weight,
    rand,
)

D_STATE, D_CONV, SSM_HEAD_DIM = 16, 4, 32


@dataclass(frozen=True)
class SSMSpec:
    arch: str
    n_layer: int
    d_inner: int
    n_group: int
    ssm_norm: bool
    attention: bool  # falcon-h1: attention and an FFN in every layer

    @property
    def n_ssm_head(self) -> int:
        return self.d_inner // SSM_HEAD_DIM

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_group * D_STATE


SPECS = {
    "mamba2": SSMSpec("mamba2", 3, 2 * N_EMBD, 2, ssm_norm=True, attention=False),
    "falcon-h1": SSMSpec("falcon-h1", 2, N_EMBD, 1, ssm_norm=False, attention=True),
}


def _metadata(w: gguf.GGUFWriter, s: SSMSpec) -> None:
    w.add_block_count(s.n_layer)
    w.add_context_length(256)
    w.add_embedding_length(N_EMBD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_ssm_conv_kernel(D_CONV)
    w.add_ssm_inner_size(s.d_inner)
    w.add_ssm_state_size(D_STATE)
    w.add_ssm_time_step_rank(s.n_ssm_head)
    w.add_ssm_group_count(s.n_group)
    if s.attention:
        w.add_feed_forward_length(N_FF)
        w.add_head_count(N_HEAD)
        w.add_head_count_kv(N_HEAD_KV)
        w.add_key_length(HEAD_DIM)
        w.add_value_length(HEAD_DIM)
        w.add_rope_freq_base(10000.0)
    else:  # what the mamba2 converter writes
        w.add_feed_forward_length(0)
        w.add_head_count(0)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)


def _ssm_tensors(w: gguf.GGUFWriter, rng: np.random.Generator, p: str, s: SSMSpec) -> None:
    h = s.n_ssm_head
    d_in_proj = 2 * s.d_inner + 2 * s.n_group * D_STATE + h  # z, x, B, C, dt
    w.add_tensor(p + "ssm_in.weight", rand(rng, d_in_proj, N_EMBD))
    w.add_tensor(p + "ssm_conv1d.weight", rand(rng, s.conv_dim, D_CONV, scale=0.5))
    w.add_tensor(p + "ssm_conv1d.bias", rand(rng, s.conv_dim, scale=0.1))
    dt = np.exp(rng.uniform(np.log(1e-2), np.log(2e-1), h))  # softplus(dt + bias) near dt
    w.add_tensor(p + "ssm_dt.bias", np.log(np.expm1(dt)).astype(np.float32))
    # A = -exp(A_log), stored as ggml {1, n_head}; D likewise
    w.add_tensor(p + "ssm_a", -rng.uniform(1.0, 8.0, (h, 1)).astype(np.float32))
    w.add_tensor(p + "ssm_d", (1.0 + 0.1 * rng.standard_normal((h, 1))).astype(np.float32))
    if s.ssm_norm:
        w.add_tensor(
            p + "ssm_norm.weight",
            norm_weight(rng, s.d_inner).reshape(s.n_group, s.d_inner // s.n_group),
        )
    w.add_tensor(p + "ssm_out.weight", rand(rng, N_EMBD, s.d_inner))


def _attention_ffn_tensors(w: gguf.GGUFWriter, rng: np.random.Generator, p: str) -> None:
    q_len, kv_len = N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM
    w.add_tensor(p + "attn_q.weight", rand(rng, q_len, N_EMBD))
    w.add_tensor(p + "attn_k.weight", rand(rng, kv_len, N_EMBD))
    w.add_tensor(p + "attn_v.weight", rand(rng, kv_len, N_EMBD))
    w.add_tensor(p + "attn_output.weight", rand(rng, N_EMBD, q_len))
    # NOTE: llama.cpp names falcon-h1's FFN norm without the ".weight" suffix
    w.add_tensor(p + "ffn_norm", norm_weight(rng, N_EMBD))
    w.add_tensor(p + "ffn_gate.weight", rand(rng, N_FF, N_EMBD))
    w.add_tensor(p + "ffn_up.weight", rand(rng, N_FF, N_EMBD))
    w.add_tensor(p + "ffn_down.weight", rand(rng, N_EMBD, N_FF))


def write_ssm(name: str, path: Path, seed: int = 0, chat_template: str | None = None) -> Path:
    s = SPECS[name]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), s.arch)
    w.add_name(f"tiny-{name}")
    _metadata(w, s)
    add_tokenizer(w, chat_template)
    w.add_tensor("token_embd.weight", rand(rng, N_VOCAB, N_EMBD, scale=0.5))
    w.add_tensor("output_norm.weight", norm_weight(rng, N_EMBD))
    if s.attention:
        w.add_tensor("output.weight", rand(rng, N_VOCAB, N_EMBD))
    for il in range(s.n_layer):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", norm_weight(rng, N_EMBD))
        _ssm_tensors(w, rng, p, s)
        if s.attention:
            _attention_ffn_tensors(w, rng, p)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_mamba2(path: Path, seed: int = 0, chat_template: str | None = None) -> Path:
    return write_ssm("mamba2", path, seed, chat_template)


def write_falcon_h1(path: Path, seed: int = 0, chat_template: str | None = None) -> Path:
    return write_ssm("falcon-h1", path, seed, chat_template)


tiny_gguf.WRITERS["mamba2"] = write_mamba2
tiny_gguf.WRITERS["falcon-h1"] = write_falcon_h1
