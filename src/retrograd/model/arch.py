"""What each architecture does differently, as one table of facts.

The decoder reads these facts once at construction and never tests `arch ==` in the forward
pass. Facts mirror llama.cpp's graph builders (src/models/<arch>.cpp in its tree): the rope
pairing on the file's own row order, the FFN activation, where norms sit, and the defaults
llama.cpp assumes when a metadata key is absent. No torch here.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, replace

ROPE_NORM = "norm"  # rotate consecutive pairs (2i, 2i+1): llama after the converter's permutation
ROPE_NEOX = "neox"  # rotate half: pairs (i, i + n_rot/2)


@dataclass(frozen=True)
class ArchFacts:
    name: str
    rope: str
    ffn_act: str  # "silu" or "gelu_tanh"; applied to the gate, times up
    fused_qkv: bool = False  # phi3: one attn_qkv tensor
    fused_gate_up: bool = False  # phi3: ffn_up holds gate then up
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope (qwen3, gemma3)
    sandwich_norms: bool = False  # post_attention_norm and post_ffw_norm (gemma2, gemma3)
    embed_scale: bool = False  # multiply embeddings by sqrt(n_embd) (gemma)
    attn_softcap: bool = False  # tanh soft-capping of attention scores (gemma2)
    final_softcap_default: float = 0.0  # soft-capping of logits when the key is absent
    swa_pattern_default: int = 0  # sliding-window layer pattern; 0 means no window
    swa_default: int = 0  # window when the key is absent
    swa_needs_key: bool = True  # gemma3 uses a window only when the file names one
    big_model_head_scale_layers: int = -1  # n_layer at which q scale is 1/sqrt(n_embd/n_head)
    rope_freqs_tensor: bool = False  # llama 3: rope_freqs.weight divides the frequencies
    attn_output_gate: bool = False  # qwen35: attn_q is (query, gate) per head; o *= sigmoid(gate)
    rope_sections: bool = False  # qwen35: interleaved M-RoPE sections (text: equal positions)
    delta_net_grouped_heads: bool = False  # qwen3next: value head j reads key head j // (H_v/H_k)
    lora_targets_auto: tuple[str, ...] = ("q", "k", "v", "o", "ffn_gate", "ffn_up", "ffn_down")
    # (tensor suffix present in a layer -> its token mixer), first match; else "attention"
    mixers: tuple[tuple[str, str], ...] = ()
    pre_norms: bool = True  # attn_norm and ffn_norm before each sub-layer (olmo2: none)
    output_norm: str = "output_norm"  # the final norm's tensor (lfm2: token_embd_norm)
    qk_norm_full: bool = False  # olmo2: one RMSNorm over all heads of q (and of k) before rope
    multipliers: bool = False  # granite: embedding, residual, attention and logit scales
    rope_finetuned_switch: bool = False  # granite: rope.scaling.finetuned = false: no rope
    no_rope_every: int = 0  # smollm3: every n-th layer (il + 1 divisible by n) has no rope
    attn_temperature: bool = False  # mistral3: llama 4's position-dependent scale of q
    yarn_keys: bool = False  # mistral3: YaRN betas and log multiplier read from the file
    # mixtures of experts, as the family calls llama.cpp's build_moe_ffn
    expert_gating: str = "softmax"  # softmax, sigmoid, softmax_weight; "key": the file says
    expert_norm: bool = False  # divide the selected experts' weights by their sum
    expert_act: str = "silu"  # the experts' gated activation: silu or swiglu_oai (gpt-oss)
    attn_sinks: bool = False  # gpt-oss: attn_sinks, one logit per head in the softmax
    ffn_norm_tensor: str = "ffn_norm"  # gpt-oss stores its pre-FFN norm as post_attention_norm
    swa_rope_scaled: bool = False  # gpt-oss: window layers keep the file's rope scaling (YaRN)


ARCHS: dict[str, ArchFacts] = {
    "llama": ArchFacts("llama", ROPE_NORM, "silu", rope_freqs_tensor=True),
    "qwen2": ArchFacts("qwen2", ROPE_NEOX, "silu"),
    "qwen3": ArchFacts("qwen3", ROPE_NEOX, "silu", qk_norm=True),
    "gemma3": ArchFacts(
        "gemma3",
        ROPE_NEOX,
        "gelu_tanh",
        qk_norm=True,
        sandwich_norms=True,
        embed_scale=True,
        swa_pattern_default=6,
        big_model_head_scale_layers=62,
    ),
    "gemma2": ArchFacts(
        "gemma2",
        ROPE_NEOX,
        "gelu_tanh",
        sandwich_norms=True,
        embed_scale=True,
        attn_softcap=True,
        final_softcap_default=30.0,
        swa_pattern_default=2,
        swa_default=4096,
        swa_needs_key=False,
        big_model_head_scale_layers=46,
    ),
    "granite": ArchFacts(
        "granite",
        ROPE_NORM,
        "silu",
        rope_freqs_tensor=True,
        multipliers=True,
        rope_finetuned_switch=True,
    ),
    "olmo2": ArchFacts(
        "olmo2",
        ROPE_NEOX,
        "silu",
        qk_norm_full=True,
        sandwich_norms=True,
        pre_norms=False,
        swa_pattern_default=4,  # olmo3 files (olmo2 with a window): 3 local, 1 global
    ),
    "smollm3": ArchFacts("smollm3", ROPE_NORM, "silu", no_rope_every=4),
    "mistral3": ArchFacts(
        "mistral3",
        ROPE_NORM,
        "silu",
        rope_freqs_tensor=True,
        attn_temperature=True,
        yarn_keys=True,
    ),
    "phi3": ArchFacts(
        "phi3",
        ROPE_NEOX,
        "silu",
        fused_qkv=True,
        fused_gate_up=True,
        lora_targets_auto=("qkv", "o", "ffn_up", "ffn_down"),
    ),
    "qwen35": ArchFacts(
        "qwen35",
        ROPE_NEOX,
        "silu",
        qk_norm=True,
        mixers=(("ssm_a", "delta_net"),),
        attn_output_gate=True,
        rope_sections=True,
        ffn_norm_tensor="post_attention_norm",
        # attention layers' q, k, v, o and the delta-net layers' attn_qkv and ssm_out
        lora_targets_auto=("q", "k", "v", "qkv", "o", "ssm_out", "ffn_gate", "ffn_up", "ffn_down"),
    ),
    "lfm2": ArchFacts(
        "lfm2",
        ROPE_NEOX,
        "silu",
        qk_norm=True,
        mixers=(("shortconv.in_proj", "shortconv"),),
        output_norm="token_embd_norm",
    ),
    # state-space families: no attention in mamba2's layers, and no FFN; falcon-h1 runs
    # attention and the SSM side by side on one normed input (multipliers are in its weights)
    "mamba2": ArchFacts(
        "mamba2",
        ROPE_NORM,
        "silu",
        mixers=(("ssm_in", "ssm"),),
        lora_targets_auto=("ssm_in", "ssm_out"),
    ),
    "falcon-h1": ArchFacts(
        "falcon-h1",
        ROPE_NEOX,
        "silu",
        mixers=(("ssm_in", "attention_ssm"),),
        lora_targets_auto=(
            "q",
            "k",
            "v",
            "o",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
            "ssm_in",
            "ssm_out",
        ),
    ),
    "qwen3moe": ArchFacts("qwen3moe", ROPE_NEOX, "silu", qk_norm=True, expert_norm=True),
    "olmoe": ArchFacts("olmoe", ROPE_NEOX, "silu", qk_norm_full=True),
    "lfm2moe": ArchFacts(
        "lfm2moe",
        ROPE_NEOX,
        "silu",
        qk_norm=True,
        mixers=(("shortconv.in_proj", "shortconv"),),
        output_norm="token_embd_norm",
        expert_gating="key",
        expert_norm=True,
    ),
    "gpt-oss": ArchFacts(
        "gpt-oss",
        ROPE_NEOX,
        "silu",
        swa_pattern_default=2,
        expert_gating="softmax_weight",
        expert_act="swiglu_oai",
        attn_sinks=True,
        ffn_norm_tensor="post_attention_norm",
        swa_rope_scaled=True,
    ),
}

# Qwen 3.5's MoE and Qwen3-Next: its delta-net layers with experts in every FFN (normalized
# weights); Qwen3-Next's value heads read their key heads in groups, and its rope has no sections.
ARCHS["qwen35moe"] = replace(ARCHS["qwen35"], name="qwen35moe", expert_norm=True)
ARCHS["qwen3next"] = replace(
    ARCHS["qwen35moe"], name="qwen3next", rope_sections=False, delta_net_grouped_heads=True
)

# Block tensors that are neither matmul weights nor norms, whatever their shape: kept as float32
# tensors (`Block.part(name)`), never LoRA targets.
FLOAT_PARTS: set[str] = {"shortconv.conv.weight", "ssm_conv1d.weight"}

# LoRA target aliases -> the GGUF tensor suffix they stand for.
TARGET_ALIASES: dict[str, str] = {
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "o": "attn_output",
    "qkv": "attn_qkv",
    "ffn_gate": "ffn_gate",
    "ffn_up": "ffn_up",
    "ffn_down": "ffn_down",
    "output": "output",
    "ssm_in": "ssm_in",
    "ssm_out": "ssm_out",
}


def alias_suffixes(alias: str) -> tuple[str, ...]:
    """The tensor suffixes a target alias names: the FFN aliases name the experts' 3-D
    tensors (ffn_up -> ffn_up, ffn_up_exps) as well as the dense matrices."""
    suffix = TARGET_ALIASES[alias]
    return (suffix, suffix + "_exps") if suffix.startswith("ffn_") else (suffix,)


def auto_targets(names: list[str], auto: tuple[str, ...]) -> tuple[str, ...]:
    """The family's `auto` aliases in this file's layout: llama.cpp loads one fused attn_qkv in
    place of attn_q, attn_k and attn_v (and the other way round), so q, k, v and qkv stand for
    whichever the file has."""
    fused, split = bool(match_targets(names, "qkv")), bool(match_targets(names, "q"))
    out: list[str] = []
    for t in auto:
        if t in ("q", "k", "v") and fused and not split:
            t = "qkv"
        group = ("q", "k", "v") if t == "qkv" and split and not fused else (t,)
        out += [a for a in group if a not in out]
    return tuple(out)


def match_targets(names: list[str], target: str) -> list[str]:
    """The base names (blk.3.attn_q) an alias or a tensor pattern selects."""
    if target in TARGET_ALIASES:
        suffixes = alias_suffixes(target)
        ends = tuple("." + s for s in suffixes)
        return [n for n in names if n in suffixes or n.endswith(ends)]
    pattern = target if target.endswith(".weight") or "*" in target else target + ".weight"
    return [n for n in names if fnmatch.fnmatchcase(n + ".weight", pattern)]
