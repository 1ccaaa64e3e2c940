"""Tiny GGUF mixtures of experts: qwen3moe, olmoe, gpt-oss and lfm2moe.

Eight experts of 128 hidden units, two used per token, in their 3-D tensors (n_expert, n_out,
n_in) as converters write them. qwen3moe normalizes the selected softmax weights; olmoe does
not and norms q and k over the whole projection; gpt-oss softmaxes the selected logits, has
biases everywhere, attention sinks, sliding layers and its clamped activation; lfm2moe has a
dense first layer, sigmoid gating with a selection bias, and short-convolution layers. Each
writer registers itself in tiny_gguf.WRITERS on import; llama.cpp loads every file as written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
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

N_EXPERT, N_EXPERT_USED, N_FF_EXP = 8, 2, 128
ROUTER_SCALE = 2.0  # router logits of a few units: routing far from ties


@dataclass
class MoESpec:
    arch: str
    n_layer: int = 2
    n_head_kv: int = N_HEAD_KV
    tied: bool = False
    qk_norm: str = ""  # "head": per head (qwen3moe); "full": over the projection (olmoe)
    attn_bias: bool = False  # q, k, v and output biases (gpt-oss)
    sinks: bool = False  # attn_sinks (gpt-oss)
    ffn_norm: str = "ffn_norm"  # gpt-oss names its pre-FFN norm post_attention_norm
    expert_bias: bool = False  # router and expert biases (gpt-oss)
    keys: Callable[[gguf.GGUFWriter], None] | None = None
    rope_base: float = 10000.0


def _gpt_oss_keys(w: gguf.GGUFWriter) -> None:
    w.add_sliding_window(8)  # pattern 2: even layers slide, odd layers see everything
    w.add_expert_feed_forward_length(N_FF_EXP)


def _gpt_oss_yarn_keys(w: gguf.GGUFWriter) -> None:
    """The released gpt-oss rope: YaRN, factor 32 over an original 4096 tokens, base 150000
    (the ramp then spans rotary pairs 8-17 of 32), in every layer, windowed or not."""
    _gpt_oss_keys(w)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)


def _qwen3moe_keys(w: gguf.GGUFWriter) -> None:
    w.add_expert_feed_forward_length(N_FF_EXP)


SPECS: dict[str, MoESpec] = {
    "qwen3moe": MoESpec("qwen3moe", qk_norm="head", keys=_qwen3moe_keys),
    "olmoe": MoESpec("olmoe", n_head_kv=N_HEAD, qk_norm="full"),
    "gpt-oss": MoESpec(
        "gpt-oss",
        attn_bias=True,
        sinks=True,
        ffn_norm="post_attention_norm",
        expert_bias=True,
        keys=_gpt_oss_keys,
    ),
}
SPECS["gpt-oss-yarn"] = replace(SPECS["gpt-oss"], keys=_gpt_oss_yarn_keys, rope_base=150000.0)


def write_moe(name: str, path: Path, seed: int = 0, chat_template: str | None = None) -> Path:
    spec = SPECS[name]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), spec.arch)
    _header(w, f"tiny-{name}", spec.n_layer, spec.n_head_kv, chat_template, base=spec.rope_base)
    if spec.keys is not None:
        spec.keys(w)
    _globals(w, rng, spec.tied)
    q_len, kv_len = N_HEAD * HEAD_DIM, spec.n_head_kv * HEAD_DIM
    for il in range(spec.n_layer):
        b = f"blk.{il}."
        w.add_tensor(b + "attn_norm.weight", norm_weight(rng, N_EMBD))
        for t, n in (("attn_q", q_len), ("attn_k", kv_len), ("attn_v", kv_len)):
            w.add_tensor(b + t + ".weight", rand(rng, n, N_EMBD))
            if spec.attn_bias:
                w.add_tensor(b + t + ".bias", rand(rng, n, scale=0.1))
        if spec.qk_norm == "head":
            w.add_tensor(b + "attn_q_norm.weight", norm_weight(rng, HEAD_DIM))
            w.add_tensor(b + "attn_k_norm.weight", norm_weight(rng, HEAD_DIM))
        elif spec.qk_norm == "full":
            w.add_tensor(b + "attn_q_norm.weight", norm_weight(rng, q_len))
            w.add_tensor(b + "attn_k_norm.weight", norm_weight(rng, kv_len))
        w.add_tensor(b + "attn_output.weight", rand(rng, N_EMBD, q_len))
        if spec.attn_bias:
            w.add_tensor(b + "attn_output.bias", rand(rng, N_EMBD, scale=0.1))
        if spec.sinks:  # one logit per head beside the keys
            w.add_tensor(b + "attn_sinks.weight", rand(rng, N_HEAD, scale=1.0))
        w.add_tensor(b + spec.ffn_norm + ".weight", norm_weight(rng, N_EMBD))
        add_experts(w, rng, b, bias=spec.expert_bias)
    return _close(w, path)


LFM2_KINDS = ("conv", "attn", "conv", "attn")  # layer 0 keeps a dense FFN
LFM2_L_CACHE = 3


def write_lfm2moe(path: Path, seed: int = 0, chat_template: str | None = None) -> Path:
    """LFM2-MoE: short-convolution and attention layers, a dense first FFN, then experts
    picked by sigmoid scores plus a selection bias (exp_probs_b), weights normalized."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "lfm2moe")
    _header(w, "tiny-lfm2moe", len(LFM2_KINDS), 0, chat_template, ffn=N_FF)
    w.add_head_count_kv([N_HEAD_KV if k == "attn" else 0 for k in LFM2_KINDS])
    w.add_uint32("lfm2moe.shortconv.l_cache", LFM2_L_CACHE)
    w.add_leading_dense_block_count(1)
    w.add_expert_feed_forward_length(N_FF_EXP)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    _globals(w, rng, tied=True, norm="token_embd_norm")
    for il, kind in enumerate(LFM2_KINDS):
        b = f"blk.{il}."
        w.add_tensor(b + "attn_norm.weight", norm_weight(rng, N_EMBD))
        if kind == "attn":
            w.add_tensor(b + "attn_q.weight", rand(rng, N_HEAD * HEAD_DIM, N_EMBD))
            w.add_tensor(b + "attn_k.weight", rand(rng, N_HEAD_KV * HEAD_DIM, N_EMBD))
            w.add_tensor(b + "attn_v.weight", rand(rng, N_HEAD_KV * HEAD_DIM, N_EMBD))
            w.add_tensor(b + "attn_q_norm.weight", norm_weight(rng, HEAD_DIM))
            w.add_tensor(b + "attn_k_norm.weight", norm_weight(rng, HEAD_DIM))
            w.add_tensor(b + "attn_output.weight", rand(rng, N_EMBD, N_HEAD * HEAD_DIM))
        else:
            w.add_tensor(b + "shortconv.conv.weight", rand(rng, N_EMBD, LFM2_L_CACHE, scale=0.5))
            w.add_tensor(b + "shortconv.in_proj.weight", rand(rng, 3 * N_EMBD, N_EMBD))
            w.add_tensor(b + "shortconv.out_proj.weight", rand(rng, N_EMBD, N_EMBD))
        w.add_tensor(b + "ffn_norm.weight", norm_weight(rng, N_EMBD))
        if il == 0:
            w.add_tensor(b + "ffn_gate.weight", rand(rng, N_FF, N_EMBD))
            w.add_tensor(b + "ffn_up.weight", rand(rng, N_FF, N_EMBD))
            w.add_tensor(b + "ffn_down.weight", rand(rng, N_EMBD, N_FF))
        else:
            add_experts(w, rng, b, bias=False)
            w.add_tensor(b + "exp_probs_b.bias", rand(rng, N_EXPERT, scale=0.5))
    return _close(w, path)


def add_experts(w: gguf.GGUFWriter, rng: np.random.Generator, b: str, bias: bool) -> None:
    """The router and three 3-D expert tensors of one layer (with biases when asked)."""
    router = rand(rng, N_EXPERT, N_EMBD) * ROUTER_SCALE
    w.add_tensor(b + "ffn_gate_inp.weight", router)
    shapes = {
        "ffn_gate_exps": (N_EXPERT, N_FF_EXP, N_EMBD),
        "ffn_up_exps": (N_EXPERT, N_FF_EXP, N_EMBD),
        "ffn_down_exps": (N_EXPERT, N_EMBD, N_FF_EXP),
    }
    for t, shape in shapes.items():
        w.add_tensor(b + t + ".weight", rand(rng, *shape))
    if bias:
        w.add_tensor(b + "ffn_gate_inp.bias", rand(rng, N_EXPERT, scale=0.5))
        for t, shape in shapes.items():
            w.add_tensor(b + t + ".bias", rand(rng, *shape[:2], scale=0.1))


def _header(
    w,
    name: str,
    n_layer: int,
    n_head_kv,
    chat_template: str | None,
    ffn: int = N_FF_EXP,
    base: float = 10000.0,
) -> None:
    w.add_name(name)
    w.add_block_count(n_layer)
    w.add_context_length(256)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(ffn)  # olmoe sizes its experts by it
    w.add_head_count(N_HEAD)
    if n_head_kv:
        w.add_head_count_kv(n_head_kv)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(base)
    w.add_expert_count(N_EXPERT)
    w.add_expert_used_count(N_EXPERT_USED)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_tokenizer(w, chat_template)


def _globals(w, rng: np.random.Generator, tied: bool, norm: str = "output_norm") -> None:
    w.add_tensor("token_embd.weight", rand(rng, N_VOCAB, N_EMBD, scale=0.5))
    w.add_tensor(norm + ".weight", norm_weight(rng, N_EMBD))
    if not tied:
        w.add_tensor("output.weight", rand(rng, N_VOCAB, N_EMBD))


def _close(w: gguf.GGUFWriter, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _writer(name: str):
    return lambda path, seed=0, chat_template=None: write_moe(name, path, seed, chat_template)


for _name in SPECS:
    tiny_gguf.WRITERS[_name] = _writer(_name)
tiny_gguf.WRITERS["lfm2moe"] = write_lfm2moe
NAMES = ("gpt-oss", "lfm2moe", "olmoe", "qwen3moe")  # one file per family
