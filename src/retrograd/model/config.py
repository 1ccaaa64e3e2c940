"""ModelConfig: the hyper-parameters of a GGUF model, read as llama.cpp reads them.

Knows metadata keys and llama.cpp's defaults for absent keys; does not know torch or tensors
beyond their names and shapes. Unsupported architectures and rope schemes fail here, before
any weight is touched.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from retrograd.errors import GGUFError, UnsupportedError
from retrograd.gguf import GGUFFile
from retrograd.model.arch import ARCHS, ArchFacts

f32 = np.float32


@dataclass(frozen=True)
class Yarn:
    """Rope scaling beyond the linear factor, as llama.cpp hands it to ggml_rope_ext."""

    ext_factor: float  # 1 under YaRN: the ramp between interpolated and extrapolated angles
    attn_factor: float  # multiplies cos and sin (with YaRN's own 1 + 0.1 ln(factor))
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0  # the context the model was trained at before scaling


@dataclass(frozen=True)
class ExpertRouting:
    """A mixture of experts' routing, as llama.cpp's build_moe_ffn receives it (moe.route)."""

    n_expert: int
    n_used: int  # experts per token (top k)
    gating: str  # softmax, sigmoid or softmax_weight (softmax over the selected logits)
    norm: bool  # divide the selected weights by their sum
    act: str  # the experts' gated activation: silu or swiglu_oai


# llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_* values, as files store expert_gating_func
GATING_FUNCS = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}


@dataclass(frozen=True)
class ModelConfig:
    arch: ArchFacts
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int  # key length
    head_dim_v: int
    n_rot: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_base_swa: float
    rope_freq_scale: float  # 1 / linear scaling factor
    swa_window: int  # 0: no sliding window
    swa_layers: tuple[bool, ...]  # per layer: uses the sliding window
    attn_scale: float  # multiplies q before q @ k^T
    attn_softcap: float  # 0: none
    final_softcap: float  # 0: none
    tied_output: bool
    layer_mixer: tuple[str, ...] = ()  # per layer: "attention" or a name in families.MIXERS
    layer_ffn: tuple[str, ...] = ()  # per layer: "dense", "moe" or "none"
    shortconv_l_cache: int = 0  # lfm2: the short convolution's kernel length
    yarn: Yarn | None = None  # None: plain rope (times rope_freq_scale)
    rope_freq_scale_swa: float = 1.0  # sliding-window layers' scale (no YaRN there)
    layer_rope: tuple[bool, ...] = ()  # per layer: rope on q and k (smollm3: not every 4th)
    embedding_scale: float = 1.0  # granite: multiplies the token embeddings
    residual_scale: float = 1.0  # granite: multiplies each sub-layer's output
    logit_scale: float = 1.0  # granite: divides the logits
    attn_temp_scale: float = 0.0  # mistral3: q *= 1 + scale * ln(floor(pos / floor_len) + 1)
    attn_temp_floor: int = 0
    # state-space layers (mamba2, falcon-h1; llama.cpp's hparams.ssm_*): conv kernel length,
    # inner size, state size, heads (the "time step rank"), groups of B and C
    ssm_d_conv: int = 0
    ssm_d_inner: int = 0
    ssm_d_state: int = 0
    ssm_dt_rank: int = 0
    ssm_n_group: int = 0
    moe: ExpertRouting | None = None  # the routing of the layers with experts

    @property
    def plain(self) -> bool:
        """Attention and a dense FFN in every layer, without the steps the fused decode graph
        lacks (olmo2's whole-projection q/k norms, granite's residual scale, mistral3's query
        temperature, layers without rope)."""
        extra = self.arch.qk_norm_full or self.residual_scale != 1.0 or self.attn_temp_scale
        extra = extra or not all(self.layer_rope)
        return not extra and not self.recurrent and all(f == "dense" for f in self.layer_ffn)

    @property
    def recurrent(self) -> bool:
        """Whether some layer carries a state from token to token besides keys and values."""
        return any(m != "attention" for m in self.layer_mixer)

    @property
    def name(self) -> str:
        return self.arch.name

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> ModelConfig:
        arch_name = g.architecture
        if arch_name not in ARCHS:
            raise UnsupportedError(
                f"{g.path.name}: architecture {arch_name!r} is not supported "
                f"(supported: {', '.join(sorted(ARCHS))})"
            )
        arch = ARCHS[arch_name]
        key = g.arch_get

        def required(k: str):
            v = key(k)
            if v is None:
                raise UnsupportedError(f"{g.path.name}: missing metadata key {arch_name}.{k}")
            return v

        n_layer = _count(g, arch_name, "block_count", required("block_count"))
        _check_blocks(g, arch_name, n_layer)
        n_embd = _count(g, arch_name, "embedding_length", required("embedding_length"))
        n_head = _per_layer_uniform(g, "attention.head_count", required("attention.head_count"))
        n_head_kv = _per_layer_uniform(
            g, "attention.head_count_kv", key("attention.head_count_kv", n_head)
        )
        # a file whose every FFN is a mixture of experts may size only its experts
        ff = (
            key("feed_forward_length", 0)
            if key("expert_count")
            else required("feed_forward_length")
        )
        n_ff = _per_layer_uniform(g, "feed_forward_length", ff)
        per_head = n_embd // n_head if n_head else 0  # mamba2: no attention, head_count 0
        head_dim = int(key("attention.key_length", per_head))
        head_dim_v = int(key("attention.value_length", per_head))
        n_rot = int(key("rope.dimension_count", head_dim))
        if not 0 <= n_rot <= max(head_dim, head_dim_v):  # it sizes the rope's tables
            raise GGUFError(
                f"{g.path.name}: {arch_name}.rope.dimension_count = {n_rot}: must be at most "
                f"the head dimension ({max(head_dim, head_dim_v)})"
            )
        _check_rope_scaling(g, arch_name)
        _check_rope_sections(g, arch, n_rot)
        factor = float(key("rope.scaling.factor", 0.0) or key("rope.scale_linear", 0.0) or 0.0)
        rope_base = float(key("rope.freq_base", 10000.0))

        window, swa_layers = _sliding_window(g, arch, n_layer)
        rope_base_swa = float(
            key("rope.freq_base_swa", 10000.0 if arch_name not in SWA_BASE_IS_BASE else rope_base)
        )
        if n_layer == arch.big_model_head_scale_layers:
            attn_scale = 1.0 / (n_embd / n_head) ** 0.5
        else:
            attn_scale = 1.0 / head_dim**0.5 if head_dim else 1.0
        if arch.multipliers and key("attention.scale"):
            attn_scale = float(key("attention.scale"))
        n_vocab = int(key("vocab_size", 0) or len(g.get("tokenizer.ggml.tokens") or []))
        if not n_vocab:
            n_vocab = g.tensor("token_embd.weight").shape[0]
        return cls(
            arch=arch,
            n_layer=n_layer,
            n_embd=n_embd,
            n_ff=n_ff,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            head_dim_v=head_dim_v,
            n_rot=n_rot,
            n_vocab=n_vocab,
            n_ctx_train=int(key("context_length", 4096)),
            rms_eps=float(required("attention.layer_norm_rms_epsilon")),
            rope_base=rope_base,
            rope_base_swa=rope_base_swa,
            rope_freq_scale=_freq_scale(g, factor),
            swa_window=window,
            swa_layers=swa_layers,
            attn_scale=attn_scale,
            attn_softcap=float(key("attn_logit_softcapping", 50.0)) if arch.attn_softcap else 0.0,
            final_softcap=float(key("final_logit_softcapping", arch.final_softcap_default) or 0.0),
            tied_output=not g.has_tensor("output.weight"),
            layer_mixer=tuple(_mixer(g, arch, il) for il in range(n_layer)),
            layer_ffn=tuple(_ffn(g, il) for il in range(n_layer)),
            moe=_moe(g, arch, n_layer),
            shortconv_l_cache=int(key("shortconv.l_cache", 0) or 0),
            **_ssm(g),
            **_rope_and_scales(g, arch, n_layer, factor),
        )


def _ssm(g: GGUFFile) -> dict:
    """The ssm.* keys, 0 where absent (llama.cpp requires them of the families that read them)."""
    keys = {
        "ssm_d_conv": "ssm.conv_kernel",
        "ssm_d_inner": "ssm.inner_size",
        "ssm_d_state": "ssm.state_size",
        "ssm_dt_rank": "ssm.time_step_rank",
        "ssm_n_group": "ssm.group_count",
    }
    return {field: int(g.arch_get(k, 0) or 0) for field, k in keys.items()}


def _mixer(g: GGUFFile, arch: ArchFacts, il: int) -> str:
    """The layer's token mixer: the first of the facts' (tensor -> mixer) rules it matches."""
    for suffix, mixer in arch.mixers:
        if g.has_tensor(f"blk.{il}.{suffix}.weight") or g.has_tensor(f"blk.{il}.{suffix}"):
            return mixer
    return "attention"


def _ffn(g: GGUFFile, il: int) -> str:
    if g.has_tensor(f"blk.{il}.ffn_gate_inp.weight"):
        return "moe"
    return "dense" if g.has_tensor(f"blk.{il}.ffn_down.weight") else "none"


def _per_layer_uniform(g: GGUFFile, k: str, v) -> int:
    """llama.cpp accepts per-layer arrays for some counts; we support uniform ones (zeros
    mark layers without attention: lfm2's convolution layers)."""
    if isinstance(v, (list, tuple)) or hasattr(v, "shape"):
        values = {int(x) for x in v if int(x)} or {0}
        if len(values) != 1:
            raise UnsupportedError(
                f"{g.path.name}: {g.architecture}.{k} varies across layers; not supported"
            )
        return values.pop()
    return int(v)


def _check_rope_scaling(g: GGUFFile, arch_name: str) -> None:
    kind = g.arch_get("rope.scaling.type", "linear") or "linear"
    if kind not in ("linear", "none", "yarn"):
        raise UnsupportedError(
            f"{g.path.name}: {arch_name}.rope.scaling.type = {kind!r} is not supported "
            "(linear, yarn and none are)"
        )
    if g.has_tensor("rope_factors_long.weight") or g.has_tensor("blk.0.rope_factors_long.weight"):
        raise UnsupportedError(
            f"{g.path.name}: LongRoPE factors (rope_factors_long) are not supported"
        )


def _count(g: GGUFFile, arch_name: str, k: str, value) -> int:
    """A metadata count: a whole number of at least 1, else a GGUFError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise GGUFError(
            f"{g.path.name}: {arch_name}.{k} = {value!r:.40}: must be a whole number >= 1"
        )
    return int(value)


def _check_blocks(g: GGUFFile, arch_name: str, n_layer: int) -> None:
    """block_count sizes a tuple a layer before any tensor is read: it may not claim blocks the
    file does not hold (a file claiming 10^8 would take minutes and gigabytes to refuse)."""
    held = {int(name.split(".", 2)[1]) for name in g.tensors if _BLOCK.match(name)}
    if g.tensors and n_layer > (max(held) + 1 if held else 0):
        raise GGUFError(
            f"{g.path.name}: {arch_name}.block_count = {n_layer}, but the file holds tensors for "
            f"{len(held)} block{'s' * (len(held) != 1)}"
        )


_BLOCK = re.compile(r"blk\.\d+\.")


def _check_rope_sections(g: GGUFFile, arch: ArchFacts, n_rot: int) -> None:
    """Interleaved M-RoPE (qwen35) on text: llama.cpp gives the t, h and w sections the token's
    position and the fourth 0, so the rope is NEOX over n_rot when every rotated pair falls in
    t, h or w (as in the released models). Pairs of the fourth would not turn: not supported."""
    if not arch.rope_sections:
        return
    sections = g.arch_get("rope.dimension_sections")
    s = [] if sections is None else [int(x) for x in sections][:4]
    s += [0] * (4 - len(s))
    for pair in range(n_rot // 2):
        sector = pair % max(sum(s), 1)
        if not any(sector % 3 == i and sector < 3 * s[i] for i in range(3)):
            raise UnsupportedError(
                f"{g.path.name}: {arch.name}.rope.dimension_sections = {s} leaves rotary pair "
                f"{pair} of {n_rot // 2} outside the text sections; not supported"
            )


def _sliding_window(g: GGUFFile, arch: ArchFacts, n_layer: int) -> tuple[int, tuple[bool, ...]]:
    """Window size and which layers use it, as llama.cpp's load_swa_pattern decides."""
    window = g.arch_get("attention.sliding_window")
    if arch.swa_pattern_default == 0 or (arch.swa_needs_key and not window):
        return 0, (False,) * n_layer
    window = int(window or arch.swa_default)
    pattern = g.arch_get("attention.sliding_window_pattern", arch.swa_pattern_default)
    if isinstance(pattern, (list, tuple)) or hasattr(pattern, "shape"):
        layers = tuple(bool(x) for x in pattern)[:n_layer]
    else:
        n = int(pattern)
        layers = tuple(n == 0 or (il % n < n - 1) for il in range(n_layer))
    return window, layers


# Families whose sliding-window layers default to the global rope base (llama.cpp: 10000).
SWA_BASE_IS_BASE = ("gemma2", "olmo2", "gpt-oss")


def _freq_scale(g: GGUFFile, factor: float) -> float:
    """llama.cpp's cparams.rope_freq_scale: 1 / factor in float32; 1 under scaling type none."""
    if not factor or (g.arch_get("rope.scaling.type", "linear") or "linear") == "none":
        return 1.0
    return float(f32(1.0) / f32(factor))


def _rope_and_scales(g: GGUFFile, arch: ArchFacts, n_layer: int, factor: float) -> dict:
    """The per-family fields: YaRN, per-layer rope, granite's multipliers, the temperature."""
    key = g.arch_get
    n_ctx_orig = int(key("rope.scaling.original_context_length", 0) or 0)
    n_ctx_orig = n_ctx_orig or int(key("context_length", 0) or 0)
    rope_on = [True] * n_layer
    if arch.no_rope_every:
        rope_on = [(il + 1) % arch.no_rope_every != 0 for il in range(n_layer)]
    if arch.rope_finetuned_switch and key("rope.scaling.finetuned", True) is False:
        rope_on = [False] * n_layer
    out = dict(
        yarn=_yarn(g, arch, factor, n_ctx_orig),
        layer_rope=tuple(rope_on),
    )
    if arch.swa_rope_scaled:  # llama.cpp: rope_freq_scale_train_swa = rope_freq_scale_train
        out["rope_freq_scale_swa"] = _freq_scale(g, factor)
    if arch.multipliers:
        out.update(
            embedding_scale=float(key("embedding_scale", 0.0) or 1.0),
            residual_scale=float(key("residual_scale", 0.0) or 1.0),
            logit_scale=float(key("logit_scale", 0.0) or 1.0),
        )
    if arch.attn_temperature and key("attention.temperature_scale"):
        out.update(
            attn_temp_scale=float(key("attention.temperature_scale")), attn_temp_floor=n_ctx_orig
        )
    return out


def _yarn(g: GGUFFile, arch: ArchFacts, factor: float, n_ctx_orig: int) -> Yarn | None:
    """ggml_rope_ext's ext_factor, attn_factor, betas and original context as llama_context
    sets them (its defaults: betas 32 and 1; attn_factor 1 times rope.scaling.attn_factor)."""
    key = g.arch_get
    attn = f32(key("rope.scaling.attn_factor", 1.0) or 1.0)
    if (key("rope.scaling.type", "linear") or "linear") != "yarn":
        return None if attn == 1.0 else Yarn(ext_factor=0.0, attn_factor=float(attn))
    fast, slow, log_mul = 32.0, 1.0, 0.0
    if arch.yarn_keys:
        fast = float(key("rope.scaling.yarn_beta_fast", fast))
        slow = float(key("rope.scaling.yarn_beta_slow", slow))
        log_mul = float(key("rope.scaling.yarn_log_multiplier", log_mul) or 0.0)
    scale = f32(1.0) / f32(_freq_scale(g, factor))  # back from the frequency scale, as llama.cpp

    def mscale(m: float) -> np.float32:
        return f32(1.0) if scale <= 1.0 else f32(0.1) * f32(m) * logf(scale) + f32(1.0)

    yarn_attn = mscale(1.0) / mscale(log_mul) if log_mul else mscale(1.0)
    yarn_attn = yarn_attn * (f32(1.0) / (f32(1.0) + f32(0.1) * logf(scale)))
    return Yarn(1.0, float(yarn_attn * attn), fast, slow, n_ctx_orig)


def logf(x) -> np.float32:
    """C's logf: the float32 nearest to the natural logarithm."""
    return f32(math.log(float(x)))


def _moe(g: GGUFFile, arch: ArchFacts, n_layer: int) -> ExpertRouting | None:
    """The experts' routing when some layer has a router (ffn_gate_inp), else None."""
    if not any(_ffn(g, il) == "moe" for il in range(n_layer)):
        return None
    key, where = g.arch_get, f"{g.path.name}: {g.architecture}"
    gating = arch.expert_gating
    if gating == "key":
        value = int(key("expert_gating_func", 0) or 0)
        if value not in GATING_FUNCS:
            raise UnsupportedError(f"{where}.expert_gating_func = {value}: not supported")
        gating = GATING_FUNCS[value]
    if int(key("expert_group_count", 0) or 0) > 1:
        raise UnsupportedError(f"{where}.expert_group_count > 1 (grouped routing): not supported")
    n_expert = int(key("expert_count", 0) or 0)
    n_used = _per_layer_uniform(g, "expert_used_count", key("expert_used_count", 0) or 0)
    if not 0 < n_used <= n_expert:
        raise UnsupportedError(f"{where}: expert_used_count {n_used} of {n_expert} experts")
    return ExpertRouting(n_expert, n_used, gating, arch.expert_norm, arch.expert_act)
